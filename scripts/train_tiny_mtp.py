"""Train the MTP modules of a tiny DeepSeek checkpoint (main model frozen) and write the folder back.

    python scripts/train_tiny_mtp.py --model checkpoints/tiny-deepseek-v3 --depth 2 --seed 0

DeepSeek-V3's sequential MTP (report, section 2.2) with ``--depth`` modules: module ``k`` (0-based)
at position ``i`` reads the previous module's output there (the main model's final hidden state for
``k = 0``) and the token ``t_{i+k+1}``, and is trained on ``t_{i+k+2}`` with the shared head, each
module's cross-entropy weighted alike. That is how the engine drafts from a checkpoint with several
modules (``agent_infer/engine/drafts/mtp.py``): module ``k`` proposes the ``k + 1``-th draft token.
The main model, the shared embedding and head, and the checkpoint's own MTP module (module 0,
trained with the main model, whose predictions it matches best) stay exactly as they are: their
stored tensors are copied byte for byte. The new modules start from copies of module 0; with
``--train-first`` module 0 is trained along (and re-exported). The corpus, its order and every batch come from ``--seed`` as in ``train_tiny_deepseek.py``,
so a run with the same seed, data and ``--threads`` writes the same bytes.

The folder gets the new modules (module 0 keeps DeepSeek's copy of the head, FP8 as before; the
others use the main head), ``num_nextn_predict_layers = --depth`` in ``config.json``, and an
``mtp_training`` entry in ``training.json`` (settings, speed, the per-module loss curve).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_deepseek import export
from tiny_deepseek.corpus import token_stream
from tiny_deepseek.mtp import MTPModule

from agent_infer.model.families.deepseek_chat import CHAT_TEMPLATE, tokenizer_dir
from agent_infer.model.loading.hf import hf_weights
from agent_infer.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
BIAS_UPDATE = 1e-3  # DeepSeek-V3's bias update speed gamma, as in train_tiny_deepseek.py
MODULE_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "hc_head.")


def widened(config: dict[str, Any], depth: int) -> dict[str, Any]:
    """``config`` with ``depth`` more decoder layers (the MTP blocks; V4: sliding, top-k routed)."""
    wide = dict(config)
    wide.pop("quantization_config", None)
    wide["num_hidden_layers"] = config["num_hidden_layers"] + depth
    if "layer_types" in wide:
        wide["layer_types"] = [*config["layer_types"], *["sliding_attention"] * depth]
        wide["mlp_layer_types"] = [*config["mlp_layer_types"], *["moe"] * depth]
    return wide


def from_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """transformers' model of ``config`` over ``tensors`` (missing ones keep their initialization)."""
    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(tmp) / "model.safetensors"))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return model


class Stack:
    """The frozen main model and the ``depth`` MTP modules being trained."""

    def __init__(self, folder: Path, depth: int, seed: int, train_first: bool) -> None:
        torch.manual_seed(seed)
        self.config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        self.arch = "v4" if self.config["model_type"] == "deepseek_v4" else "v3"
        n = self.config["num_hidden_layers"]
        self.n, self.depth = n, depth
        tensors = dict(hf_weights(folder))
        prefix = f"model.layers.{n}."
        main = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
        self.main = from_tensors(widened(self.config, 0), main).eval()
        for p in self.main.parameters():
            p.requires_grad_(False)
        block_tensors = {
            k: v for k, v in tensors.items() if not k.removeprefix(prefix).startswith(MODULE_OWN)
        }
        host = from_tensors(widened(self.config, 1), block_tensors)
        first = MTPModule(
            self.config["hidden_size"],
            self.config["rms_norm_eps"],
            host.model.layers[n],
            self.config.get("hc_mult", 1),
            self._hyper_head() if self.arch == "v4" else None,
        )
        with torch.no_grad():
            for name, param in first.named_parameters():
                key = prefix + {"head_norm.weight": "shared_head.norm.weight"}.get(name, name)
                if not name.startswith("block."):
                    param.copy_(tensors[key])
        self.modules = torch.nn.ModuleList([first, *(copy.deepcopy(first) for _ in range(depth - 1))])
        #: The first module that trains (and is written back); the ones before keep their stored tensors.
        self.trained = 0 if train_first else 1
        for module in self.modules[: self.trained]:
            for p in module.parameters():
                p.requires_grad_(False)
        trained = self.modules[self.trained :]
        self.routers = [m for m in trained.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = [torch.zeros(self.config["n_routed_experts"]) for _ in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(_counter(load))
        self.stored_head = prefix + "shared_head.head.weight"

    def _hyper_head(self) -> torch.nn.Module:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

        return v4.DeepseekV4HyperHead(self.main.config)

    def losses(
        self,
        window: torch.Tensor,
        active: torch.Tensor,
        remap: torch.Tensor,
        unused: float,
        distill: bool = False,
    ) -> list[torch.Tensor]:
        """Each module's cross-entropy on windows ``[B, L + depth + 1]``: against the text's token,
        or (``distill``) against the main model's own distribution of that token."""
        length = int(window.shape[1]) - self.depth - 1
        embed = self.main.model.embed_tokens
        rows = embed.weight[active]
        with torch.no_grad():
            states = self.main.model(input_ids=window[:, : length + self.depth]).last_hidden_state
            hidden = states[:, :length]
            teacher = None
            if distill:
                teacher = F.linear(states.reshape(-1, int(states.shape[-1])), rows).float()
                pad = teacher.new_full((int(teacher.shape[0]), 1), unused)
                teacher = torch.softmax(torch.cat((teacher, pad), dim=1), dim=1).view(*states.shape[:2], -1)
        positions = torch.arange(length).unsqueeze(0).expand(int(window.shape[0]), -1)
        out = []
        for k, module in enumerate(self.modules):
            tokens = window[:, k + 1 : k + 1 + length]
            kwargs = self._block_kwargs(hidden, embed(tokens), positions, tokens)
            with torch.set_grad_enabled(torch.is_grad_enabled() and k >= self.trained):
                hidden = module.trunk(hidden, embed(tokens), **kwargs)
            logits = F.linear(module.head_norm(hidden).reshape(-1, int(hidden.shape[-1])), rows).float()
            pad = logits.new_full((int(logits.shape[0]), 1), unused)
            logits = torch.cat((logits, pad), dim=1)
            if teacher is not None:
                # The main model at position i + k + 1 scores exactly what verification compares with.
                soft = teacher[:, k + 1 : k + 1 + length].reshape(int(logits.shape[0]), -1)
                out.append(-(soft * F.log_softmax(logits, dim=1)).sum(dim=1).mean())
            else:
                out.append(F.cross_entropy(logits, remap[window[:, k + 2 : k + 2 + length].reshape(-1)]))
        return out

    def _block_kwargs(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> dict[str, Any]:
        rotary = self.main.model.rotary_emb
        if self.arch == "v3":
            return {
                "position_embeddings": rotary(hidden, positions),
                "attention_mask": None,
                "position_ids": positions,
            }
        from transformers.masking_utils import create_sliding_window_causal_mask

        return {
            "position_embeddings": {
                k: rotary(embeds, position_ids=positions, layer_type=k) for k in ("main", "compress")
            },
            "attention_mask": create_sliding_window_causal_mask(
                config=self.main.config,
                inputs_embeds=embeds,
                attention_mask=None,
                cache=None,
                position_ids=positions,
            ),
            "position_ids": positions,
            "input_ids": tokens,
        }

    def balance(self) -> None:
        """Auxiliary-loss-free balancing of the modules' routers (as the main training does)."""
        with torch.no_grad():
            for router, load in zip(self.routers, self.loads):
                router.e_score_correction_bias += BIAS_UPDATE * torch.sign(load.mean() - load)
                load.zero_()

    def module_tensors(self) -> dict[str, torch.Tensor]:
        """Every module's tensors by checkpoint name (blocks named like decoder layers)."""
        host = self.main.__class__(self.main.config.__class__(**widened(self.config, self.depth)))
        out: dict[str, torch.Tensor] = {}
        for k in range(self.trained, self.depth):
            module = self.modules[k]
            host.model.layers[self.n + k].load_state_dict(module.block.state_dict())
            prefix = f"model.layers.{self.n + k}."
            out.update({prefix + name: t.float().clone() for name, t in module.checkpoint_tensors().items()})
        wide, _ = export.saved_tensors(host)
        for name, t in wide.items():
            if any(name.startswith(f"model.layers.{self.n + k}.") for k in range(self.trained, self.depth)):
                out[name] = t
        return out


def _counter(load: torch.Tensor) -> Any:
    def hook(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        load.add_(torch.bincount(out[-1].reshape(-1), minlength=load.numel()).float())

    return hook


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def write(folder: Path, out: Path, stack: Stack, report: dict[str, Any]) -> None:
    """The folder with the main tensors as stored and the new modules."""
    from safetensors import safe_open

    stored: dict[str, torch.Tensor] = {}
    old = f"model.layers.{stack.n}."
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            if not name.startswith(old) or name.startswith(stack.stored_head) or stack.trained > 0:
                stored[name] = f.get_tensor(name)
    new, _ = export.to_checkpoint(stack.module_tensors())
    stored.update(new)
    config = dict(stack.config)
    config["num_nextn_predict_layers"] = stack.depth
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    quant = config.pop("quantization_config")
    export.write_folder(out, stored, config, tok_cfg)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == quant
    training = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    training["mtp_training"] = report
    (out / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    for extra in folder.iterdir():  # e.g. the draft vocabulary's ranking, a tokenizer.json
        if extra.is_file() and not (out / extra.name).exists():
            (out / extra.name).write_bytes(extra.read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a tiny DeepSeek folder")
    parser.add_argument("--out", type=Path, default=None, help="default: --model")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "maskbench-dev")
    parser.add_argument("--train-first", action="store_true", help="train the checkpoint's module too")
    parser.add_argument(
        "--distill",
        action="store_true",
        help="targets: the main model's distributions, not the text's tokens",
    )
    args = parser.parse_args(argv)
    if args.depth < 1 or (args.depth == 1 and not args.train_first):
        parser.error("--depth must be at least 1, and at least 2 unless --train-first")
    out = args.out or args.model
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = Tokenizer.from_hf_dir(tokenizer_dir(), default_chat_template=CHAT_TEMPLATE)
    ids, _ = token_stream(args.data, tokenizer, args.seed)
    stream = torch.tensor(ids, dtype=torch.int64)
    span = args.seq_len + args.depth + 1
    held_out = stream[-8 * span :].view(8, span)
    train = stream[: -8 * span]
    stack = Stack(args.model, args.depth, args.seed, args.train_first)
    vocab = stack.config["vocab_size"]
    active = torch.unique(stream)
    remap = torch.full((vocab,), -1, dtype=torch.int64)
    remap[active] = torch.arange(len(active))
    unused = math.log(vocab - len(active))
    params = [p for p in stack.modules.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        starts = torch.randint(0, len(train) - span, (args.batch,), generator=gen)
        window = torch.stack([train[s : s + span] for s in starts.tolist()])
        losses = stack.losses(window, active, remap, unused, args.distill)
        opt.zero_grad(set_to_none=True)
        sum(losses).backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        stack.balance()
        if step % args.eval_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                evals = stack.losses(held_out, active, remap, unused, args.distill)
            rate = (step + 1) / (time.perf_counter() - t0)
            curve.append(
                {
                    "step": step,
                    "train": [round(float(x), 4) for x in losses],
                    "eval": [round(float(x), 4) for x in evals],
                }
            )
            print(
                f"step {step:4d}  train {[round(float(x), 3) for x in losses]}  eval {[round(float(x), 3) for x in evals]}  {rate:.2f} steps/s",
                flush=True,
            )
    seconds = time.perf_counter() - t0
    report = {
        "depth": args.depth, "train_first": args.train_first, "distill": args.distill, "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "threads": args.threads, "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(time.process_time() - cpu0, 1), "curve": curve, "torch": torch.__version__,
    }  # fmt: skip
    write(args.model, out, stack, report)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
