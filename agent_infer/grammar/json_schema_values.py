"""Deciding whether one concrete JSON value satisfies a schema (for ``enum``/``const`` filtering).

When a schema lists its values, every other keyword only filters that finite list, so even keywords
a grammar cannot express (``not``, ``oneOf``, ``if``/``then``/``else``, ``uniqueItems``,
``dependentRequired``/``dependentSchemas``) are decided exactly, per value, here. The remaining
keywords are checked by running the schema's own (strict) grammar on the value's JSON text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.grammar.json_schema_merge import canon, is_annotation, values

if TYPE_CHECKING:
    from agent_infer.grammar.json_schema import Compiler

_LOGIC = (
    "not",
    "anyOf",
    "oneOf",
    "__conditionals",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "enum",
    "const",
)
MAX_DEPTH = 32


def value_valid(c: Compiler, schema: Any, v: Any, pointer: str, depth: int = 0) -> bool:
    """Exact validity of ``v`` under ``schema`` (raises UnsupportedSchemaError like strict lowering)."""
    if depth > MAX_DEPTH:
        from agent_infer.errors import GrammarLimitError

        raise GrammarLimitError(
            f"schema nesting deeper than {MAX_DEPTH} while checking enum values at {pointer}"
        )
    flat = c.flatten(schema, pointer)
    if isinstance(flat, bool):
        return flat
    vals = values(flat)
    if vals is not None and canon(v) not in {canon(x) for x in vals}:
        return False
    if "enum" in flat and "const" in flat and canon(v) != canon(flat["const"]):
        return False

    def sub(s: Any, where: str) -> bool:
        return value_valid(c, s, v, f"{pointer}/{where}", depth + 1)

    if "not" in flat and sub(flat["not"], "not"):
        return False
    if "anyOf" in flat and not any(sub(b, f"anyOf/{i}") for i, b in enumerate(flat["anyOf"])):
        return False
    if "oneOf" in flat and sum(sub(b, f"oneOf/{i}") for i, b in enumerate(flat["oneOf"])) != 1:
        return False
    for cond in flat.get("__conditionals", []):
        branch = "then" if sub(cond["if"], "if") else "else"
        if not sub(cond[branch], branch):
            return False
    if flat.get("uniqueItems") is True and isinstance(v, list) and len({canon(x) for x in v}) != len(v):
        return False
    if isinstance(v, dict):
        for trigger, deps in flat.get("dependentRequired", {}).items():
            if trigger in v and any(d not in v for d in deps):
                return False
        for trigger, dep in flat.get("dependentSchemas", {}).items():
            if trigger in v and not sub(dep, f"dependentSchemas/{trigger}"):
                return False
    rest = {k: x for k, x in flat.items() if k not in _LOGIC and not is_annotation(k)}
    if not rest:
        return True
    return c.value_matcher(rest, pointer, strict=c.strict, record=True)(v)
