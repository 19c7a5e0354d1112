"""Agent-task evaluation: do SDK calls on the default model return valid, correct objects?

Tasks (``data/agent_tasks.jsonl``, models in ``agent_tasks_models.py``): extraction into Pydantic
models (nested, optional, enums, dates, e-mails, lists, dicts, recursive), classification with
``choice``, regex answers, and tool calls (``tool_choice`` required and auto) with expected
arguments. Each runs through the real SDK (``AsyncClient`` in local mode, up to ``--concurrency``
calls in flight: the engine's output per request does not depend on the batch), in four
configurations: greedy and temperature 0.7 (seeded per task), with the SDK's loop control
(``loop_control=None``, the default) and without it (``loop_control=False``).

Metrics per configuration: ``valid`` (calls that returned a value: validated object, choice, regex
match or the expected kind of tool call), ``length`` (model requests that ended at ``max_tokens``,
retries included), ``length_structured`` (the same without requests of ``tool_choice="auto"`` tasks
that answered in free text), ``closing_attempts`` (last attempts after ``length`` failures, which
close the document at ``max_tokens`` when loop control is on), ``field_acc`` (gold fields equal, over all gold fields of the extraction,
choice and regex tasks: strings compared case-insensitively, numbers to 1e-6, lists of scalars
as multisets), ``tool_acc`` (tool tasks whose first call has the expected name and arguments),
completion tokens and wall time.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/eval_agent_tasks.py [--limit N] [--failures]
[--configs greedy-off,greedy-on,t07-off,t07-on] [--out eval.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import agent_tasks_models as models

from agent_infer.client import AsyncClient, Hooks, LoopControl, ResponseEvent
from agent_infer.errors import AgentInferError

DATA = Path(__file__).parent / "data" / "agent_tasks.jsonl"
CONFIGS = {
    "greedy-off": (0.0, False),
    "greedy-on": (0.0, None),
    "t07-off": (0.7, False),
    "t07-on": (0.7, None),
}
MAX_TOKENS = 200
SEED = 1234


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Current weather for a city."""
    return f"{city}: 20 degrees {unit}"


def send_email(to: str, subject: str, body: str) -> str:
    """Send an e-mail."""
    return "sent"


def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
    """Convert an amount between currencies (ISO codes such as USD, EUR)."""
    return "converted"


def create_reminder(text: str, date: str) -> str:
    """Create a reminder for a date (YYYY-MM-DD)."""
    return "created"


TOOLS = [get_weather, send_email, convert_currency, create_reminder]


@dataclass
class Result:
    """One task's outcome in one configuration."""

    id: str
    kind: str
    valid: bool
    fields_right: int = 0
    fields_total: int = 0
    tool_right: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    seconds: float = 0.0
    answer: Any = None
    error: str | None = None
    length_tails: list[str] = field(default_factory=list)
    text_answers: list[str] = field(default_factory=list)
    closing: list[str] = field(default_factory=list)


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten ``value`` to ``{path: leaf}``; a list of scalars is one leaf (compared as a multiset)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        out = {f"{prefix}#len": len(value)}
        for i, v in enumerate(value):
            out.update(leaves(v, f"{prefix}.{i}"))
        return out
    return {prefix: value}


def same(gold: Any, got: Any) -> bool:
    """Leaf equality: case-insensitive strings, numbers to 1e-6, lists of scalars as multisets."""
    if isinstance(gold, list):
        return isinstance(got, list) and Counter(map(_norm, gold)) == Counter(map(_norm, got))
    if isinstance(gold, bool) or gold is None:
        return gold is got
    if isinstance(gold, int | float):
        return isinstance(got, int | float) and not isinstance(got, bool) and abs(gold - got) < 1e-6
    return _norm(gold) == _norm(got)


def _norm(v: Any) -> Any:
    return v.strip().casefold() if isinstance(v, str) else v


def score_fields(gold: Any, got: Any) -> tuple[int, int]:
    """(gold leaves matched, gold leaves)."""
    gold_leaves = leaves(gold)
    got_leaves = leaves(got) if got is not None else {}
    right = sum(1 for k, v in gold_leaves.items() if k in got_leaves and same(v, got_leaves[k]))
    return right, len(gold_leaves)


async def run_task(
    client: AsyncClient, task: dict[str, Any], temperature: float, loop: Any, seed: int
) -> Result:
    """Run one task through the SDK and score it."""
    reasons: list[str] = []
    tails: list[str] = []  # where outputs cut off at max_tokens ended: the loop, if any
    text_answers: list[str] = []  # finish reasons of tool-task requests answered in free text
    closing: list[str] = []  # finish reasons of last attempts that close at max_tokens
    kind = task["kind"]
    tokens = [0]

    def on_response(event: ResponseEvent) -> None:
        reasons.append(event.finish_reason)
        tokens[0] += event.usage.completion_tokens
        if event.response is not None and kind == "tool" and not event.response.tool_calls:
            text_answers.append(event.finish_reason)
        if event.request.loop_last_attempt and loop is not False:
            closing.append(event.finish_reason)
        if event.finish_reason == "length":
            tails.append(event.text[-200:])

    hooks = Hooks(on_response=on_response)
    opts: dict[str, Any] = {
        "temperature": temperature,
        "seed": seed if temperature > 0 else None,
        "max_tokens": task.get("max_tokens", MAX_TOKENS),
        "loop_control": loop,
        "hooks": hooks,
    }
    gold = task["gold"]
    result = Result(task["id"], kind, valid=False)
    start = time.perf_counter()
    try:
        if kind == "tool":
            message = await client.chat(
                [{"role": "user", "content": task["prompt"]}],
                tools=TOOLS,
                tool_choice=task["tool_choice"],
                **opts,
            )
            calls = message.get("tool_calls") or []
            if calls:
                fn = calls[0]["function"]
                args = json.loads(fn["arguments"])
                result.answer = {"name": fn["name"], "arguments": args}
                result.valid = True
                result.tool_right = fn["name"] == gold["name"] and all(
                    same(v, args.get(k)) for k, v in gold["arguments"].items()
                )
            else:
                result.answer = message.get("content")
                result.valid = task["tool_choice"] == "auto"
        else:
            constraint: dict[str, Any] = {
                "extract": lambda: {"schema": getattr(models, task["schema"])},
                "choice": lambda: {"choice": task["choices"]},
                "regex": lambda: {"regex": task["regex"]},
            }[kind]()
            value = await client.generate(task["prompt"], **constraint, **opts)
            result.valid = True
            result.answer = value.model_dump(mode="json") if kind == "extract" else value
            if kind == "extract":
                result.fields_right, result.fields_total = score_fields(gold, result.answer)
            else:
                result.fields_right, result.fields_total = int(same(gold, value)), 1
    except AgentInferError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        if kind != "tool":
            result.fields_total = 1 if kind != "extract" else len(leaves(gold))
    result.seconds = time.perf_counter() - start
    result.finish_reasons = reasons
    result.length_tails = tails
    result.text_answers = text_answers
    result.closing = closing
    result.completion_tokens = tokens[0]
    return result


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    """The configuration's metrics."""
    requests = [r for res in results for r in res.finish_reasons]
    tools = [r for r in results if r.kind == "tool"]
    total = sum(r.fields_total for r in results)
    text = [r for res in results for r in res.text_answers]
    structured_lengths = requests.count("length") - text.count("length")
    return {
        "tasks": len(results),
        "valid": sum(r.valid for r in results) / len(results),
        "requests": len(requests),
        "length": requests.count("length") / max(len(requests), 1),
        "length_structured": structured_lengths / max(len(requests) - len(text), 1),
        "closing_attempts": sum(len(r.closing) for r in results),
        "field_acc": sum(r.fields_right for r in results) / max(total, 1),
        "tool_acc": sum(r.tool_right for r in tools) / max(len(tools), 1),
        "completion_tokens": sum(r.completion_tokens for r in results),
        "wall_s": wall,
    }


async def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every requested configuration over the (limited) task list."""
    tasks = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    # The seed offset is the task's line in the data file, so a subset samples what the full run does.
    for i, task in enumerate(tasks):
        task["_line"] = i
    if args.only:
        tasks = [t for t in tasks if any(part in t["id"] for part in args.only.split(","))]
    tasks = tasks[: args.limit] if args.limit else tasks
    report: dict[str, Any] = {"configs": {}, "results": {}}
    engine = (
        {k: _number(v) for k, v in (kv.split("=") for kv in args.engine.split(","))} if args.engine else {}
    )
    async with AsyncClient(max_num_seqs=args.concurrency, **engine) as client:
        await client.generate("warm up", choice=["a", "b"])
        gate = asyncio.Semaphore(args.concurrency)
        for name in args.configs.split(","):
            temperature, loop = CONFIGS[name]
            if loop is None and args.loop:
                loop = LoopControl(
                    **{k: _number(v) for k, v in (kv.split("=") for kv in args.loop.split(","))}
                )

            async def one(i: int, task: dict[str, Any], t: float = temperature, lc: Any = loop) -> Result:
                async with gate:
                    return await run_task(client, task, t, lc, args.seed + i)

            start = time.perf_counter()
            results = await asyncio.gather(*(one(t["_line"], t) for t in tasks))
            summary = summarize(results, time.perf_counter() - start)
            report["configs"][name] = summary
            report["results"][name] = [r.__dict__ for r in results]
            print(f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()), flush=True)
            if args.failures:
                print(failures(results), flush=True)
    return report


def failures(results: list[Result]) -> str:
    """The tasks of one configuration that failed or had a request end ``length``: id, finish
    reasons, the end of each cut-off output, the error, and the answer."""
    lines = []
    for r in results:
        if r.valid and "length" not in r.finish_reasons:
            continue
        kind = "free text" if r.text_answers else r.kind
        lines.append(f"  {r.id} ({kind}): valid={r.valid} finish={r.finish_reasons}")
        lines += [f"    cut off: ...{tail!r}" for tail in r.length_tails]
        if r.error:
            lines.append(f"    error: {r.error}")
        lines.append(f"    answer: {json.dumps(r.answer, default=str)[:200]}")
    return "\n".join(lines) or "  (none)"


def _number(text: str) -> Any:
    return {"true": True, "false": False}.get(text) if text in ("true", "false") else json.loads(text)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def table(report: dict[str, Any]) -> str:
    """The configurations x metrics as a Markdown table."""
    cols = [
        "valid",
        "length",
        "length_structured",
        "field_acc",
        "tool_acc",
        "requests",
        "closing_attempts",
        "completion_tokens",
        "wall_s",
    ]
    lines = ["| config | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, s in report["configs"].items():
        cells = [
            f"{s[c]:.1%}"
            if c in ("valid", "length", "length_structured", "field_acc", "tool_acc")
            else _fmt(s[c])
            for c in cols
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, evaluate, print the table, write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="first N tasks only")
    parser.add_argument("--only", default="", help="comma-separated substrings of task ids")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--seed", type=int, default=SEED, help="the task on line i of the data samples with seed SEED + i"
    )
    parser.add_argument(
        "--loop", default="", help="the 'on' configs use LoopControl(k=v,...) instead of the SDK default"
    )
    parser.add_argument(
        "--engine", default="", help="engine options k=v,... (e.g. enable_prefix_caching=false)"
    )
    parser.add_argument(
        "--failures", action="store_true", help="print each configuration's failed and cut-off requests"
    )
    parser.add_argument("--out", default="", help="write the summary and per-task results as JSON")
    args = parser.parse_args()
    report = asyncio.run(evaluate(args))
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
