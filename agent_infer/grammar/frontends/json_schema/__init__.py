"""JSON Schema (draft 2020-12, plus draft-07 spellings) to a grammar of exactly the valid JSON texts.

Other packages reach the front end through these names; the modules below are its internals. The
names load the front end on first use, so that importing one internal module (the compiler's
``KeySet``) does not import all of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.entry import (
        check_options,
        json_schema_to_grammar,
        load_schema,
    )

_ENTRY = "agent_infer.grammar.frontends.json_schema.entry"

__all__ = ["check_options", "json_schema_to_grammar", "load_schema"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ENTRY), name)
    globals()[name] = value
    return value
