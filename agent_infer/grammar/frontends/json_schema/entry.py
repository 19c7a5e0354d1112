"""JSON Schema (draft 2020-12, plus draft-07 spellings) to a grammar of exactly the valid JSON texts.

Entry point: :func:`json_schema_to_grammar` (also ``Grammar.from_json_schema``), with
:func:`load_schema` (JSON text or a Pydantic class to a schema) and :func:`check_options`. Policies
(property order, ``format`` as assertion, integers, whitespace, unknown keywords) are documented in
``docs/json_schema.md``. The lowering is split by concern: ``resolve/`` (documents, ``$ref``,
structural keys), ``applicators/`` (``allOf`` merging, ``anyOf``/``oneOf``/``not``/``if``),
``types/`` (strings, numbers, objects, arrays), ``values/`` (``enum``/``const``), ``keys/``
(property names), driven by the :class:`~.compiler.Compiler`.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Mapping
from typing import Any

from agent_infer.errors import ConfigError, GrammarLimitError, InvalidSchemaError
from agent_infer.grammar.frontends.json_schema.compiler import Compiler
from agent_infer.grammar.frontends.json_schema.resolve.keyword_checks import MAX_INT_DIGITS, TooLongInteger
from agent_infer.grammar.frontends.json_schema.resolve.registry import build_registry
from agent_infer.grammar.frontends.json_schema.rule_writer import SHARED_RULE_PREFIX
from agent_infer.grammar.frontends.json_schema.types.number_policy import NUMBER_POLICIES

# Imported with the front end, not on first use (validating a value matcher's grammar needs it):
# where no bytecode is cached (e.g. PYTHONDONTWRITEBYTECODE) compiling a module costs milliseconds,
# which would land on whichever schema first needs it.
from agent_infer.grammar.ir import (
    Grammar,
    recognizer,  # noqa: F401
    references,  # noqa: F401
)

# Option bounds. Pinned layouts (indent) are written out per depth, so indent * MAX_INDENT_DEPTH
# spaces of literal text per line; 16 covers every indent json.dumps users pick (2, 4, 8).
# Flexible whitespace is a counted repeat of blanks at every optional spot (after a newline, at
# least MAX_LINE_INDENT): 64 is far above any real formatter's run of blanks.
MAX_INDENT = 16
MAX_WHITESPACE = 64
# What an unknown ``format`` value and an unknown keyword become: annotations by default (as the
# specification says), or errors for users who want such schemas refused.
UNKNOWN_FORMATS = ("ignore", "error")
UNKNOWN_KEYWORDS = ("ignore", "error")

__all__ = [
    "MAX_INDENT",
    "MAX_WHITESPACE",
    "NUMBER_POLICIES",
    "UNKNOWN_FORMATS",
    "UNKNOWN_KEYWORDS",
    "check_options",
    "json_schema_to_grammar",
    "load_schema",
]


def load_schema(schema: Any) -> Any:
    """A schema given as JSON text parsed (a Pydantic class as its JSON Schema, anything else as is).

    Bad text is an ``InvalidSchemaError``, text nested past Python's parser a ``GrammarLimitError``.
    """
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidSchemaError(f"schema is not valid JSON: {exc}", pointer="") from exc
        except RecursionError:
            raise GrammarLimitError("JSON Schema text nests too deeply for the JSON parser") from None
        except ValueError:
            # An integer literal past the int-to-str digit limit: parsed again keeping such
            # literals as text, so the keyword that holds one is reported with its pointer
            # (resolve/keyword_checks). NaN/Infinity (and overflowing floats) parse to non-finite
            # floats and are reported there too.
            return json.loads(schema, parse_int=_parse_int)
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return _close_objects(schema.model_json_schema())
    return schema


def _parse_int(text: str) -> int | TooLongInteger:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        return TooLongInteger(text)
    return int(text)


def _close_objects(node: Any) -> Any:
    """Pydantic drops unknown keys (``extra="ignore"``) or rejects them (``"forbid"``), so generating
    them only wastes tokens: objects that do not say otherwise get ``additionalProperties: false``.
    Models with ``extra="allow"`` state ``additionalProperties: true`` and keep it."""
    if isinstance(node, list):
        return [_close_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _close_objects(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def _check_int(name: str, value: Any, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise ConfigError(f"{name} must be an integer from 0 to {hi}, got {value!r}")


def check_options(
    *,
    strict: Any,
    whitespace: Any,
    max_whitespace: Any,
    indent: Any,
    remotes: Any,
    unknown_formats: Any = "ignore",
    unknown_keywords: Any = "ignore",
    numbers: Any = "exact",
) -> None:
    """Raise ConfigError, naming the argument and what it allows, for an option of
    :func:`json_schema_to_grammar` out of range: ``whitespace`` is ``"flexible"`` or ``"compact"``,
    ``max_whitespace`` an integer in [0, MAX_WHITESPACE], ``indent`` None or an integer in
    [0, MAX_INDENT], ``strict`` a bool, ``remotes`` None or a mapping from URI strings,
    ``unknown_formats`` and ``unknown_keywords`` ``"ignore"`` or ``"error"``, ``numbers``
    ``"exact"`` or ``"float64"``."""
    for name, value, allowed in (
        ("unknown_formats", unknown_formats, UNKNOWN_FORMATS),
        ("unknown_keywords", unknown_keywords, UNKNOWN_KEYWORDS),
        ("numbers", numbers, NUMBER_POLICIES),
    ):
        if type(value) is not str or value not in allowed:
            raise ConfigError(f"{name} must be {' or '.join(map(repr, allowed))}, got {value!r}")
    if whitespace not in ("flexible", "compact") or type(whitespace) is not str:
        raise ConfigError(f"whitespace must be 'flexible' or 'compact', got {whitespace!r}")
    _check_int("max_whitespace", max_whitespace, MAX_WHITESPACE)
    if indent is not None:
        _check_int("indent", indent, MAX_INDENT)
    if type(strict) is not bool:
        raise ConfigError(f"strict must be True or False, got {strict!r}")
    if remotes is not None and (
        not isinstance(remotes, Mapping) or not all(isinstance(uri, str) for uri in remotes)
    ):
        raise ConfigError("remotes must be a mapping from URI strings to schema documents")


def json_schema_to_grammar(
    schema: Any,
    *,
    strict: bool = True,
    whitespace: str = "flexible",
    max_whitespace: int = 2,
    indent: int | None = None,
    remotes: Mapping[str, Any] | None = None,
    unknown_formats: str = "ignore",
    unknown_keywords: str = "ignore",
    numbers: str = "exact",
) -> Grammar:
    """Compile a JSON Schema (dict, JSON text, bool, or Pydantic model class) to a Grammar.

    ``whitespace="flexible"`` allows up to ``max_whitespace`` (0 to MAX_WHITESPACE) blanks at each
    optional spot; ``indent`` (None, or 0 to MAX_INDENT spaces per level) pins the layout
    json.dumps(indent=...) writes. Options out of range raise ConfigError.
    Strict mode raises UnsupportedSchemaError for a keyword that cannot be enforced exactly;
    non-strict mode ignores it and records ``"ignored keyword K at /ptr"`` in ``Grammar.warnings``.
    An unknown ``format`` value or keyword is an annotation in either mode (recorded in
    ``Grammar.warnings`` with its pointer) unless ``unknown_formats`` / ``unknown_keywords`` is
    ``"error"``, which makes it an UnsupportedSchemaError.
    ``remotes`` maps absolute URIs to schema documents that ``$ref`` may point into.
    ``numbers="float64"`` limits numbers the schema leaves open to float64/int64 digits
    (``types/number_policy.py``); ``"exact"`` keeps JSON Schema's unbounded numbers.
    """
    check_options(
        strict=strict,
        whitespace=whitespace,
        max_whitespace=max_whitespace,
        indent=indent,
        remotes=remotes,
        unknown_formats=unknown_formats,
        unknown_keywords=unknown_keywords,
        numbers=numbers,
    )
    comp: Compiler | None = None
    over_limit = False
    try:
        registry, root = build_registry(load_schema(schema), remotes)
        comp = Compiler(
            registry,
            strict=strict,
            whitespace=whitespace,
            max_whitespace=max_whitespace,
            indent=indent,
            unknown_formats=unknown_formats,
            unknown_keywords=unknown_keywords,
            numbers=numbers,
        )
        body = comp.lower(root, "", 0)
        # Rule names come from Compiler.fresh (or fixed valid names) and every Ref names a rule
        # added with it, so the per-node validation walk is skipped (see Grammar.unchecked).
        grammar = Grammar.unchecked(
            (("root", body), *comp.rules.items()), "root", tuple(dict.fromkeys(comp.warnings))
        )
    except RecursionError:
        # The front end recurses once per nesting level; a schema nested deeper than Python's
        # stack allows is a size limit, not a crash.
        over_limit = True
        raise GrammarLimitError(
            f"JSON Schema nests too deeply to compile (Python recursion limit {sys.getrecursionlimit()})"
        ) from None
    except GrammarLimitError:
        over_limit = True
        raise
    finally:
        if comp is not None:
            comp.release()
        if over_limit:
            # A build cut off by a size limit made and dropped millions of small objects; the
            # interpreter's free lists still hold some of them, scattered over hundreds of
            # allocator arenas, until the next full collection empties the lists and unmaps the
            # arenas (10-20 ms on this box, ~0.15 ms per unmapped arena). Done here, the failing
            # call pays for its own churn instead of some later request (docs/performance.md).
            gc.collect()
    # Rules named char* ("char", "char-high", "char-special", the key-trie nodes) have bodies that
    # are the same IR objects in every grammar: the serializer caches their programs (compile/compiler.py).
    object.__setattr__(grammar, "_shared_prefix", SHARED_RULE_PREFIX)
    return grammar
