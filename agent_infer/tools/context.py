"""The context object a tool may ask for (pydantic-ai's ``RunContext``) and how a parameter asks for it."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

DepsT = TypeVar("DepsT")


@dataclass(frozen=True)
class RunContext(Generic[DepsT]):
    """What a tool that asks for it receives (pydantic-ai's ``RunContext``): annotate the tool's first
    parameter with ``RunContext[Deps]`` and it is passed the ``deps=`` of ``Client.run``.

    ``tool_name`` and ``tool_call_id`` name the call being executed, ``turn`` the model call (from 1)
    that made it. The parameter is not part of the tool's JSON schema: the model never sees it.
    """

    deps: DepsT
    tool_name: str = ""
    tool_call_id: str = ""
    turn: int = 0


def _is_context(annotation: Any) -> bool:
    return annotation is RunContext or typing.get_origin(annotation) is RunContext


def context_deps_type(annotation: Any) -> type | None:
    """The ``Deps`` of a ``RunContext[Deps]`` annotation when it is a plain class (checkable with isinstance)."""
    args = typing.get_args(annotation)
    return args[0] if len(args) == 1 and isinstance(args[0], type) and args[0] is not Any else None
