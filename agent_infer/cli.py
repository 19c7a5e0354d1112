"""The ``agent-infer`` command: one-off structured generation from the shell.

``agent-infer generate "prompt" --schema schema.json`` (or ``--regex``, ``--choice``, ``--grammar``,
``--builtin``, ``--json-object``) prints the constrained output. ``agent-infer serve`` (the
OpenAI-compatible server) is not built yet and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent_infer.errors import AgentInferError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-infer", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one completion, optionally constrained")
    gen.add_argument("prompt", help="the user message (sent through the chat template unless --raw)")
    gen.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M)")
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

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (not built yet)")
    serve.add_argument("--model", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    return parser


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
    llm = LLM(args.model)
    if args.raw:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.text)
    if out.finish_reason != "stop":
        print(f"(finish reason: {out.finish_reason})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agent-infer`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        print(
            "agent-infer serve: the OpenAI-compatible server is not built yet (it is planned on top of "
            "the SDK); use the Python API (agent_infer.LLM) meanwhile",
            file=sys.stderr,
        )
        return 2
    except (AgentInferError, OSError, json.JSONDecodeError) as exc:
        print(f"agent-infer: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
