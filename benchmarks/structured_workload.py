"""The JSON-Schema workload of ``bench_structured.py``: schema choice, prompts, validation.

Two prompt styles (``--prompts``):

* ``example`` (default): what a real request carries, as in ``tests/engine/test_structured_maskbench.py``:
  the schema's description, its field names, and one example document (the MaskBench file's
  shortest valid test instance, at most ``MAX_INSTANCE_CHARS`` characters). Files without such an
  instance are not drawn. With a description alone, greedy SmolLM2-135M often loops inside strings
  until ``max_tokens``.
* ``schema``: the description plus the whole schema text (the earlier workload).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

SYSTEM = "You are a precise assistant. Answer with a single JSON object and nothing else."
MAX_SCHEMA_CHARS = 1200
MAX_INSTANCE_CHARS = 400
MAX_FIELDS = 12


@dataclasses.dataclass
class Request:
    """One benchmark request: the schema's file name, the schema, and the prompt token ids."""

    name: str
    schema: dict[str, Any]
    prompt_ids: list[int]


def _about(schema: dict[str, Any], fallback: str) -> str:
    """The first line of the schema's description or title (at most 200 chars), else ``fallback``."""
    text = str(schema.get("description") or schema.get("title") or "").strip()
    return text.splitlines()[0][:200] if text else fallback


def _example(doc: dict[str, Any]) -> str | None:
    """The shortest valid test instance as JSON text, if one is short enough to quote."""
    valid = [json.dumps(t["data"]) for t in doc.get("tests", []) if t.get("valid")]
    best = min(valid, key=len, default=None)
    return best if best is not None and len(best) <= MAX_INSTANCE_CHARS else None


def user_prompt(doc: dict[str, Any], schema: dict[str, Any], name: str, style: str) -> str | None:
    """The user message for one schema file in ``style``; None when the file cannot supply it."""
    about = _about(schema, Path(name).stem.replace("_", " "))
    if style == "schema":
        text = json.dumps(schema, separators=(",", ":"))
        return f"Task: {about}\nProduce one JSON object that matches this JSON Schema:\n{text}"
    example = _example(doc)
    if example is None:
        return None
    text = f"Produce a JSON object for: {about}."
    props = schema.get("properties")
    if isinstance(props, dict) and props:
        text += " Fields: " + ", ".join(list(props)[:MAX_FIELDS]) + "."
    return text + f" Example: {example}\nKeep it short."


def pick_workload(loaded: Any, n: int, seed: int, data: Path, style: str = "example") -> list[Request]:
    """``n`` schemas chosen by ``seed`` among those ours compiles (and that can be prompted in ``style``)."""
    from agent_infer.grammar.compile.compiler import GrammarCompiler
    from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
    from agent_infer.structured import as_structured

    tok = loaded.tokenizer
    info = TokenizerInfo.from_tokenizer(
        tok.hf_tokenizer,
        vocab_size=loaded.config.vocab_size,
        eos_token_ids=sorted(loaded.config.eos_token_ids),
    )
    compiler = GrammarCompiler(info)
    files = sorted(data.glob("*.json"))
    random.Random(seed).shuffle(files)
    chosen: list[Request] = []
    for path in files:
        doc = json.loads(path.read_text())
        schema = doc["schema"]
        if not isinstance(schema, dict) or len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_CHARS:
            continue
        user = user_prompt(doc, schema, path.name, style)
        if user is None:
            continue
        try:
            compiler.compile(as_structured(schema).to_grammar())
        except Exception as exc:  # not compilable by ours: not part of the workload
            print(f"  skip {path.name}: {type(exc).__name__}", file=sys.stderr)
            continue
        chat = tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        )
        chosen.append(Request(path.name, schema, tok.encode(chat)))
        if len(chosen) == n:
            break
    return chosen


def validate(text: str, schema: dict[str, Any]) -> str | None:
    """None when ``text`` is JSON valid under ``schema``; else the reason."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        error = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
        )
    except Exception as exc:  # a schema jsonschema itself cannot evaluate
        return f"validator failed: {type(exc).__name__}: {exc}"
    return None if error is None else f"schema: {error.message[:200]}"
