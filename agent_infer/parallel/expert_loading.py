"""An expert-parallel rank's share of a checkpoint: its own experts, read one tensor at a time.

Under expert parallelism a rank computes only the experts of its slots (``eplb.Placement``), so it
reads only their tensors from the safetensors files, plus every replicated part (attention, dense
layers, routers, shared experts, norms, embedding, head, MTP modules). The model is built with its
routed experts' ``[E, ...]`` tensors on the ``meta`` device (shapes only:
:func:`~agent_infer.model.layers.moe.routed_experts_on`), and the checkpoint is walked name by name
through safetensors' lazy ``safe_open``. An expert tensor of another rank is never read: the
model's loader gets a ``meta`` stand-in of its shape, so its checks (every tensor once, shapes)
still hold. This rank's expert tensors are copied into its slot tensors (``[S, 2I, H]`` and
``[S, H, I]``), once per slot holding the expert. Block-FP8 weights are dequantized exactly as the
full load does them, so the slots hold bit for bit what a full load would.

The same reader fetches one expert for an EPLB weight move with ``eplb_weight_source="file"``
(:meth:`CheckpointExperts.read_expert`). A GGUF model is loaded whole and then cut to the slots.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from agent_infer.errors import ConfigError, ModelLoadError
from agent_infer.model.families.base import CausalLM
from agent_infer.model.layers.float_linear import PACKED_FLOAT, FloatPackedLinear, pack_loaded
from agent_infer.model.layers.moe import MoE, routed_experts_on
from agent_infer.model.loader import LoadedModel, build_hf_model, load_model, resolve_model_path
from agent_infer.model.loading.fp8 import SCALE_SUFFIX, dequantize_block_fp8
from agent_infer.model.loading.hf import safetensors_files
from agent_infer.model.loading.quantized import quant_format
from agent_infer.parallel.eplb import Placement


def decoder_moes(model: nn.Module) -> list[MoE]:
    """The MoE layers expert parallelism splits: the decoder's. An MTP module's MoE stays whole on
    every rank (it drafts on each rank's own schedule, outside the lock-step exchanges)."""
    decoder = getattr(model, "layers", model)
    return [m for m in decoder.modules() if isinstance(m, MoE)]


@dataclass
class ExpertSlots:
    """One MoE layer's slots on this rank: the logical expert of each slot and their weights."""

    experts: tuple[int, ...]
    gate_up: torch.Tensor  # [S, 2I, H]
    down: torch.Tensor  # [S, H, I]

    @classmethod
    def empty(cls, moe: MoE, experts: Sequence[int], device: torch.device) -> ExpertSlots:
        """Uninitialized slots shaped like ``moe``'s experts (its tensors may be ``meta``)."""
        s = len(experts)
        up, down = moe.gate_up, moe.down
        return cls(
            tuple(experts),
            torch.empty(s, *up.shape[1:], dtype=up.dtype, device=device),
            torch.empty(s, *down.shape[1:], dtype=down.dtype, device=device),
        )

    @classmethod
    def cut(cls, moe: MoE, experts: Sequence[int]) -> ExpertSlots:
        """Slots copied out of a fully loaded ``moe`` (its torch weights or its packed ones)."""
        return cls(tuple(experts), *moe.routed_weights(experts))

    def nbytes(self) -> int:
        """Bytes the slots hold."""
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


@dataclass(frozen=True)
class _ExpertPart:
    layer: int
    expert: int
    which: int  # 0: gate_up, 1: down
    offset: int  # first row inside the expert's tensor


@dataclass
class ReadStats:
    """What a rank read of the routed experts: per MoE layer, the logical experts whose tensors were
    read (at load and by file-sourced weight moves), and the bytes of those reads."""

    experts_read: list[set[int]] = field(default_factory=list)
    expert_bytes_read: int = 0


class CheckpointExperts:
    """Where every routed expert's tensors sit in an HF folder's safetensors files.

    ``model`` is built with the ``moes``' expert tensors on ``meta``; an expert's tensors are found
    through the model's load targets (views of those tensors), so any family's names work.
    """

    def __init__(self, directory: Path, model: CausalLM, moes: Sequence[MoE]) -> None:
        self.directory = directory
        self.model = model
        self.files = safetensors_files(directory)
        fmt = quant_format(_config_json(directory), f"{directory / 'config.json'}: ")
        if fmt is not None and fmt.fp4:
            # expert-by-expert reads take Hugging Face's block-FP8 naming only; the release's FP4 layout loads whole
            raise ModelLoadError(
                f"{directory}: expert-parallel loading reads block-FP8 or float experts, not FP4 (expert_dtype 'fp4')"
            )
        self.block = fmt.block if fmt is not None else None
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            with _open(path) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._file[name] = path
                    self._shape[name] = tuple(f.get_slice(name).get_shape())
        self.shapes = [(tuple(m.gate_up.shape[1:]), tuple(m.down.shape[1:]), m.gate_up.dtype) for m in moes]
        bases = {id(m.gate_up): (i, 0) for i, m in enumerate(moes)}
        bases.update({id(m.down): (i, 1) for i, m in enumerate(moes)})
        by_target: dict[str, _ExpertPart] = {}
        for name, (dest, offset, _shape) in model.weight_targets().items():
            base = dest._base
            hit = bases.get(id(base)) if base is not None else None
            if hit is not None and base is not None:
                expert = dest.storage_offset() // base.stride(0)
                by_target[name] = _ExpertPart(hit[0], expert, hit[1], offset)
        #: Stored name -> which expert tensor it fills (names as stored; ``hf_tensor`` may rename).
        self.parts: dict[str, _ExpertPart] = {}
        self._by_expert: dict[tuple[int, int], list[str]] = {}
        for name in self._file:
            if name.endswith(SCALE_SUFFIX):
                continue
            adapted = model.hf_tensor(name, _meta(self._shape[name]))
            part = by_target.get(adapted[0]) if adapted is not None else None
            if part is not None:
                self.parts[name] = part
                self._by_expert.setdefault((part.layer, part.expert), []).append(name)
        self.stats = ReadStats([set() for _ in moes])

    def weights(self, slots: Sequence[ExpertSlots]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for ``CausalLM.load_weights``: replicated tensors as read; each expert
        tensor as a ``meta`` stand-in, read (and copied into ``slots``) only when this rank holds it."""
        with ExitStack() as stack:
            handles = {path: stack.enter_context(_open(path)) for path in self.files}
            for name in self._file:
                if name.endswith(SCALE_SUFFIX):
                    if name.removesuffix(SCALE_SUFFIX) not in self._file:
                        raise ModelLoadError(
                            f"scale tensor {name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r}"
                        )
                    continue
                part = self.parts.get(name)
                if part is None:
                    item = self.model.hf_tensor(name, self._read(handles, name))
                    if item is not None:
                        yield item
                    continue
                local = [j for j, e in enumerate(slots[part.layer].experts) if e == part.expert]
                if local:
                    tensor = self._adapted(name, self._read(handles, name))
                    held = slots[part.layer].gate_up if part.which == 0 else slots[part.layer].down
                    for j in local:
                        held[j, part.offset : part.offset + int(tensor.shape[0])].copy_(tensor)
                    self._count(part, tensor)
                stand_in = self.model.hf_tensor(name, _meta(self._shape[name]))
                if stand_in is not None:
                    yield stand_in

    def read_expert(self, layer: int, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert`` of MoE layer ``layer`` from the files: its ``gate_up`` ``[2I, H]`` and
        ``down`` ``[H, I]`` (an EPLB weight move from the file)."""
        up_shape, down_shape, dtype = self.shapes[layer]
        out = (
            torch.empty(up_shape, dtype=dtype, device=device),
            torch.empty(down_shape, dtype=dtype, device=device),
        )
        names = self._by_expert.get((layer, expert), [])
        with ExitStack() as stack:
            files = {self._file[n] for n in names}
            files |= {self._file[n + SCALE_SUFFIX] for n in names if n + SCALE_SUFFIX in self._file}
            handles = {path: stack.enter_context(_open(path)) for path in files}
            for name in names:
                part = self.parts[name]
                tensor = self._adapted(name, self._read(handles, name))
                out[part.which][part.offset : part.offset + int(tensor.shape[0])].copy_(tensor)
                self._count(part, tensor)
        return out

    def _adapted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        item = self.model.hf_tensor(name, tensor)
        if item is None:  # parts are only names the family keeps
            raise ModelLoadError(f"tensor {name!r} was dropped by the model family")
        return item[1]

    def _count(self, part: _ExpertPart, tensor: torch.Tensor) -> None:
        self.stats.experts_read[part.layer].add(part.expert)
        self.stats.expert_bytes_read += tensor.numel() * tensor.element_size()

    def _read(self, handles: dict[Path, Any], name: str) -> torch.Tensor:
        """One stored tensor, a block-FP8 weight dequantized with its scale (as ``fp8_weights``)."""
        tensor = handles[self._file[name]].get_tensor(name)
        scale = name + SCALE_SUFFIX
        if tensor.dtype == torch.float8_e4m3fn:
            if scale not in self._file or self.block is None:
                raise ModelLoadError(f"FP8 tensor {name!r} has no {scale!r}")
            return dequantize_block_fp8(
                name, tensor, handles[self._file[scale]].get_tensor(scale), self.block
            )
        if scale in self._file:
            raise ModelLoadError(f"{scale!r} scales {name!r}, which is {tensor.dtype}, not float8_e4m3fn")
        return tensor


@dataclass
class RankWeights:
    """What an expert-parallel rank loaded: the model (its split MoE layers' ``[E, ...]`` tensors
    ``meta`` or full, replaced once expert parallelism is installed), those layers, their starting
    placements and this rank's slots; ``checkpoint`` reads further experts from the files (None for
    a GGUF model, loaded whole)."""

    loaded: LoadedModel
    moes: list[MoE]
    placements: list[Placement]
    slots: list[ExpertSlots]
    checkpoint: CheckpointExperts | None


def load_rank_weights(
    model: str | None,
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    place: Callable[[list[MoE]], list[Placement]],
) -> RankWeights:
    """Load ``rank``'s share of ``model``: from an HF folder, only the experts of its slots under
    the placements ``place(moes)`` returns (plus everything replicated); a GGUF model whole, then
    cut. Raises :class:`ConfigError` for a model without MoE layers."""
    path = resolve_model_path(model)
    if not (path.is_dir() and (path / "config.json").is_file()):
        loaded = load_model(model, device=device, dtype=dtype)
        moes = _moes_of(loaded)
        placements = place(moes)
        slots = [ExpertSlots.cut(m, p.rank_slots(rank)) for m, p in zip(moes, placements)]
        return RankWeights(loaded, moes, placements, slots, None)
    with routed_experts_on(torch.device("meta")):
        loaded = build_hf_model(path, device, dtype, packed_float=True)
    moes = _moes_of(loaded)
    for module in loaded.model.modules():
        if isinstance(module, MoE) and module.gate_up.is_meta and all(module is not m for m in moes):
            # Replicated MoE layers (an MTP module's) are loaded whole.
            module.gate_up = nn.Parameter(
                torch.empty_like(module.gate_up, device=device), requires_grad=False
            )
            module.down = nn.Parameter(torch.empty_like(module.down, device=device), requires_grad=False)
    placements = place(moes)
    slots = [ExpertSlots.empty(m, p.rank_slots(rank), device) for m, p in zip(moes, placements)]
    checkpoint = CheckpointExperts(path, loaded.model, moes)
    loaded.model.load_weights(checkpoint.weights(slots))
    if loaded.model.kernels.name == PACKED_FLOAT:
        # the one-process default's kernels; the split layers' slots are packed by ExpertParallel
        pack_loaded(loaded.model, split=moes)
    loaded.model.eval()
    return RankWeights(loaded, moes, placements, slots, checkpoint)


def _moes_of(loaded: LoadedModel) -> list[MoE]:
    moes = decoder_moes(loaded.model)
    if not moes:
        raise ConfigError(
            f"expert_parallel needs a MoE model; {loaded.path} ({loaded.config.architecture}) has no MoE layers"
        )
    return moes


def resident_weight_bytes(model: nn.Module, slots: Iterable[ExpertSlots] = ()) -> int:
    """Bytes of weights a rank holds: the model's non-``meta`` parameters and buffers (each storage
    once: a tied head shares the embedding's), the native copies of projections whose torch rows
    were dropped after packing (projections, routed experts), plus its expert slots (native copies
    of torch weights that stay are not counted again)."""
    seen: set[tuple[int, int]] = set()
    total = sum(
        int(m.packed.nbytes) for m in model.modules() if isinstance(m, FloatPackedLinear) and m.weight is None
    )
    total += sum(m.dropped_routed_bytes() for m in model.modules() if isinstance(m, MoE))
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta or not t.numel():
            continue
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total + sum(s.nbytes() for s in slots)


def _meta(shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), device="meta")


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc


def _config_json(directory: Path) -> dict[str, Any]:
    try:
        data = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}
