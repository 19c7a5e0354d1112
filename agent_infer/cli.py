"""The ``agent-infer`` command: one-off structured generation from the shell.

``agent-infer generate "prompt" --schema schema.json`` (or ``--regex``, ``--choice``, ``--grammar``,
``--builtin``, ``--json-object``) prints the constrained output. ``agent-infer serve`` runs the
OpenAI-compatible HTTP server (FastAPI + uvicorn; see ``docs/server.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent_infer.errors import AgentInferError
from agent_infer.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS

_MODEL_HELP = (
    f"packaged model name ({', '.join(PACKAGED_MODELS)}), GGUF file or Hugging Face folder "
    f"(default: {DEFAULT_MODEL})"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-infer", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one completion, optionally constrained")
    gen.add_argument("prompt", help="the user message (sent through the chat template unless --raw)")
    gen.add_argument("--model", default=None, help=_MODEL_HELP)
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    group = gen.add_mutually_exclusive_group()
    group.add_argument("--schema", type=Path, help="a JSON Schema file")
    group.add_argument("--regex", help="a Python-syntax regex the whole output must match")
    group.add_argument("--choice", nargs="+", help="the output is exactly one of these strings")
    group.add_argument("--grammar", type=Path, help="a GBNF (.gbnf) or Lark (.lark) grammar file")
    group.add_argument("--builtin", help="a built-in grammar name (json, sql_select, arithmetic, ...)")
    group.add_argument("--json-object", action="store_true", help="any JSON object")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--speculative-tokens", type=int, default=5, help="prompt-lookup draft length (0 = no drafts)"
    )

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=None, help=_MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="required as 'Authorization: Bearer KEY' (default: $AGENT_INFER_API_KEY)",
    )
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: file name)")
    serve.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024)
    serve.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    serve.add_argument(
        "--tool-format", default=None, help="tool-call format (default: from the chat template)"
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1"],
        help="split <think>...</think> into reasoning_content; constraints apply to the answer (default: off)",
    )
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests batched together")
    serve.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 1024 * 1024)
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="most tokens fed to the model in one step"
    )
    serve.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=16,
        help="most prompt tokens in a step while other requests decode (keeps their streams flowing)",
    )
    serve.add_argument(
        "--speculative-tokens", type=int, default=5, help="longest draft per request (0 = no drafts)"
    )
    serve.add_argument(
        "--speculative-source",
        choices=("auto", "mtp", "ngram", "off"),
        default=None,
        help="draft sources (default: AGENT_INFER_SPECULATIVE_SOURCE, else auto = MTP layers if any, plus prompt lookup)",
    )
    serve.add_argument(
        "--speculative-draft-vocab",
        type=int,
        default=None,
        help="token ids the MTP draft head chooses from, most frequent first (0 = all; default: "
        "AGENT_INFER_SPECULATIVE_DRAFT_VOCAB, else 16384)",
    )
    serve.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="one half of a prefill/decode pair behind sglang-router --pd-disaggregation (default: null)",
    )
    serve.add_argument(
        "--host-kv-cache-bytes",
        type=int,
        default=0,
        help="host memory for prefix blocks the KV pool evicts, restored on a prefix hit (0 = off)",
    )
    _parallel_arguments(serve)
    return parser


def _parallel_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("parallel MoE serving (docs/parallel.md)")
    group.add_argument(
        "--data-parallel-size", type=int, default=1, help="rank processes, each with its own requests"
    )
    group.add_argument(
        "--expert-parallel", action="store_true", help="split MoE experts over the ranks (lock-step)"
    )
    group.add_argument(
        "--redundant-experts", type=int, default=0, help="extra expert slots for EPLB replicas"
    )
    group.add_argument(
        "--eplb-interval", type=int, default=0, help="rebalance every N busy steps (0 = never)"
    )
    group.add_argument("--eplb-window", type=int, default=1000, help="steps of expert load EPLB balances")
    group.add_argument("--eplb-profile", default=None, help="saved expert-load profile: starting placement")
    group.add_argument("--num-nodes", type=int, default=1, help="rank groups for hierarchical EPLB")
    group.add_argument(
        "--eplb-weight-source",
        choices=("peer", "file"),
        default="peer",
        help="where an EPLB move gets an expert a rank lacks: a peer rank or the checkpoint files",
    )
    group.add_argument(
        "--cp-prefill-threshold",
        type=int,
        default=None,
        help="prefill prompts with at least this many tokens to compute over all ranks "
        "(else AGENT_INFER_CP_PREFILL_THRESHOLD; 0 = never)",
    )


def _structured(args: argparse.Namespace) -> object:
    from agent_infer.structured import StructuredOutput

    if args.schema is not None:
        return StructuredOutput.json_schema(args.schema.read_text(encoding="utf-8"))
    if args.regex is not None:
        return StructuredOutput.regex(args.regex)
    if args.choice:
        return StructuredOutput.choice(args.choice)
    if args.grammar is not None:
        syntax = "lark" if args.grammar.suffix == ".lark" else "gbnf"
        return StructuredOutput.ebnf(args.grammar.read_text(encoding="utf-8"), syntax=syntax)
    if args.builtin is not None:
        return StructuredOutput.builtin(args.builtin)
    if args.json_object:
        return StructuredOutput.json_object()
    return None


def _generate(args: argparse.Namespace) -> int:
    from agent_infer import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        structured=_structured(args),
    )
    llm = LLM(args.model, speculative_tokens=args.speculative_tokens)
    if args.raw:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.text)
    if out.finish_reason != "stop":
        print(f"(finish reason: {out.finish_reason})", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from agent_infer import envs
    from agent_infer.engine.config import EngineConfig
    from agent_infer.parallel import ParallelConfig
    from agent_infer.server import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.api_key(),
        model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        tool_format=args.tool_format,
        reasoning_parser=args.reasoning_parser,
        disaggregation_mode=args.disaggregation_mode,
    )
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"agent-infer serve: warning: listening on {args.host} without an API key", file=sys.stderr)
    engine_config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        speculative_tokens=args.speculative_tokens,
        host_kv_cache_bytes=args.host_kv_cache_bytes,
        speculative_source=args.speculative_source,
        speculative_draft_vocab=args.speculative_draft_vocab,
    )
    parallel = ParallelConfig(
        data_parallel_size=args.data_parallel_size,
        expert_parallel=args.expert_parallel,
        redundant_experts=args.redundant_experts,
        eplb_interval=args.eplb_interval,
        eplb_window=args.eplb_window,
        eplb_profile=args.eplb_profile,
        num_nodes=args.num_nodes,
        eplb_weight_source=args.eplb_weight_source,
        cp_prefill_threshold=args.cp_prefill_threshold,
    )
    if not parallel.enabled:
        serve(args.model, config, engine_config)
        return 0
    from typing import cast

    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.parallel import DataParallelEngine
    from agent_infer.parallel.serving import ServedDataParallel

    served = ServedDataParallel(DataParallelEngine(args.model, engine_config, parallel))
    try:
        # The server reads only the LLMEngine surface ServedDataParallel provides.
        serve(args.model, config, engine_config, engine=cast(LLMEngine, served))
    finally:
        served.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agent-infer`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _serve(args)
    except (AgentInferError, OSError, json.JSONDecodeError) as exc:
        print(f"agent-infer: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
