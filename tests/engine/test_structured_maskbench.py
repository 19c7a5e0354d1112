"""50 MaskBench schemas as request constraints on the real default model: every output validates.

The sample is drawn with a fixed seed from ``../shared/data/maskbench-dev/``; a schema joins it
when the JSON Schema front end lowers it in strict mode and the compile finishes within
``COMPILE_BUDGET_S``. The whole sample runs as one batch, greedy and then seeded sampling.

Prompts: with only a description, greedy SmolLM2-135M degenerates into repetition inside strings
and nested objects (measured: 23 of 50 schemas ran to 512 tokens, every one still a valid prefix).
Termination is the model's job and validity the engine's, so each prompt carries what a real
request would: the description, the field names, and one example document (the MaskBench file's
valid test instance). Exclusion rule (general, not by name): files without a valid instance, or
whose instance is longer than ``MAX_INSTANCE_CHARS``, are skipped when drawing. ``max_tokens`` is
per schema: a generous multiple of the example's token count.

Even so, a few outputs loop (a string repeating ``.A.A.A``, an array repeating its item) until
``max_tokens`` (measured: 7 of 50, greedy and sampled, with float32 and with the default int8
activations alike; a build whose norm rounded differently saw 8 and 11, so the bar has a margin). The test runs the sample both ways:

* default (``close_on_length=False``): the engine does not change what the model chose, so 100% of
  outputs are valid in the engine's sense (every ``stop`` output validates with ``jsonschema``,
  every ``length`` output is a prefix the grammar accepts) and at least ``MIN_STOP_SHARE`` finish
  ``stop``;
* ``close_on_length=True`` (budget-aware closing, ``agent_infer/engine/closing.py``): a request
  that would run out ends with the grammar's shortest completion, so 100% finish ``stop`` and
  validate with ``jsonschema``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from shared_data import SHARED_DATA, require_shared_data

from agent_infer import SamplingParams
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

MASKBENCH = SHARED_DATA / "maskbench-dev"
SAMPLE_SEED = 5
SAMPLE_SIZE = 50
COMPILE_BUDGET_S = 2.0
MAX_INSTANCE_CHARS = 400
MAX_TOKENS = 256
# Share of requests that must finish "stop"; the rest may run into max_tokens (see below).
MIN_STOP_SHARE = 0.76

Case = tuple[str, Any, str, int]


@pytest.fixture(scope="module", autouse=True)
def _maskbench_data() -> None:
    # module scope: it must run before the module-scoped sample below, which reads the data
    require_shared_data("maskbench-dev")


def _prompt(doc: dict[str, Any], schema: Any, example: str) -> str:
    """A realistic request: what the object is about, the field names, and an example."""
    about = ""
    if isinstance(schema, dict):
        about = str(schema.get("description") or schema.get("title") or "")
    about = about.strip().splitlines()[0][:200] if about.strip() else Path(str(doc["name"])).stem
    fields: list[str] = []
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        fields = list(schema["properties"])[:12]
    text = f"Produce a JSON object for: {about}."
    if fields:
        text += " Fields: " + ", ".join(fields) + "."
    return text + f" Example: {example}\nKeep it short."


def _example(doc: dict[str, Any]) -> str | None:
    """The shortest valid test instance as compact JSON text, if any."""
    valid = [json.dumps(t["data"]) for t in doc.get("tests", []) if t.get("valid")]
    return min(valid, key=len, default=None)


def _draw(compile_fn: Callable[[Grammar], Any], count_tokens: Callable[[str], int]) -> list[Case]:
    """(file name, schema, prompt, max_tokens) for the first SAMPLE_SIZE usable files in a seeded order."""
    files = sorted(MASKBENCH.glob("*.json"))
    random.Random(SAMPLE_SEED).shuffle(files)
    drawn: list[Case] = []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc["name"] = path.name
        example = _example(doc)
        if example is None or len(example) > MAX_INSTANCE_CHARS:
            continue
        schema = doc["schema"]
        try:
            grammar = Grammar.from_json_schema(schema, strict=True)
        except Exception:
            continue  # not lowerable in strict mode: not part of the sample
        start = time.perf_counter()
        try:
            compile_fn(grammar)
        except Exception:
            continue
        if time.perf_counter() - start > COMPILE_BUDGET_S:
            continue
        max_tokens = min(MAX_TOKENS, 48 + 2 * count_tokens(example))
        drawn.append((path.name, schema, _prompt(doc, schema, example), max_tokens))
        if len(drawn) == SAMPLE_SIZE:
            break
    return drawn


@pytest.fixture(scope="module")
def sample(llm: Any) -> list[Case]:
    drawn = _draw(llm.engine.grammar.compile, lambda text: len(llm.tokenizer.encode(text)))
    assert len(drawn) == SAMPLE_SIZE
    return drawn


# Each run is ~2 minutes of CPU decoding here. The default run covers both temperatures and both
# modes with two of the four pairs; the other two run with ``-m slow`` (``make test-all``).
@pytest.mark.parametrize(
    ("temperature", "close_on_length"),
    [
        pytest.param(0.0, False, id="0.0-plain"),
        pytest.param(0.8, True, id="0.8-closing"),
        pytest.param(0.0, True, id="0.0-closing", marks=pytest.mark.slow),
        pytest.param(0.8, False, id="0.8-plain", marks=pytest.mark.slow),
    ],
)
def test_maskbench_schemas_validate(
    llm: Any, sample: list[Case], temperature: float, close_on_length: bool
) -> None:
    params = [
        SamplingParams(
            temperature=temperature,
            seed=11 + i,
            max_tokens=max_tokens,
            structured=schema,
            close_on_length=close_on_length,
        )
        for i, (_, schema, _, max_tokens) in enumerate(sample)
    ]
    convs = [[{"role": "user", "content": prompt}] for _, _, prompt, _ in sample]
    outs = llm.chat(convs, params)
    failures: list[str] = []
    unfinished: list[str] = []
    for (name, schema, _, _), out in zip(sample, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "length" and not close_on_length:
            # Still the engine's guarantee: what was generated is a prefix of a valid document.
            matcher = GrammarMatcher(llm.engine.grammar.compile(Grammar.from_json_schema(schema)))
            if not all(matcher.accept_token(t) for t in completion.token_ids):
                failures.append(f"{name}: length output is not a grammar prefix: {out.text[:200]!r}")
            unfinished.append(f"{name}: {out.text[-80:]!r}")
            continue
        if completion.finish_reason != "stop":
            failures.append(
                f"{name}: finish {completion.finish_reason} {completion.error or ''} {out.text[:200]!r}"
            )
            continue
        try:
            value = json.loads(out.text)
            jsonschema.validate(value, schema)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]} in {out.text[:200]!r}")
            continue
        assert completion.parsed == value
    assert not failures, "\n".join(failures)
    stop_share = 1 - len(unfinished) / len(sample)
    closed = sum(1 for out in outs if out.metrics.num_closing_tokens)
    print(
        f"temperature={temperature} close_on_length={close_on_length}: "
        f"{len(sample) - len(unfinished)}/{len(sample)} finished stop, {closed} closed by the budget"
    )
    assert stop_share >= MIN_STOP_SHARE, "ran into max_tokens:\n" + "\n".join(unfinished)
    if close_on_length:
        assert not unfinished and closed > 0
