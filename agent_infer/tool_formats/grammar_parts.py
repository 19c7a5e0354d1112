"""Grammar building blocks shared by the formats: tool choice, embedded argument grammars, free text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agent_infer.grammar.ir import Empty, Expr, Grammar, Ref, Repeat, alt, chars, lit, seq
from agent_infer.structured import REQUEST_NUMBERS
from agent_infer.tools import Tool, ToolDefinitionError

ToolChoice = str | Mapping[str, Any]


def resolve_choice(tools: Sequence[Tool], tool_choice: ToolChoice) -> tuple[str, list[Tool]]:
    """(mode, the tools a call may use) from an OpenAI-style ``tool_choice``.

    The mode is "auto", "required", "none" or "named" (a dict naming one tool: exactly one call).
    "auto" without tools is "none": there is nothing to call.
    """
    if isinstance(tool_choice, Mapping):
        name = tool_choice.get("name") or tool_choice.get("function", {}).get("name")
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise ToolDefinitionError(
                f"tool_choice names {name!r}, which is not one of the tools", field="tool_choice"
            )
        return "named", chosen
    if tool_choice not in ("auto", "required", "none"):
        raise ToolDefinitionError(
            f"tool_choice must be 'auto', 'required', 'none' or {{'name': ...}}, not {tool_choice!r}",
            field="tool_choice",
        )
    if tool_choice != "none" and not tools:
        if tool_choice == "required":
            raise ToolDefinitionError("tool_choice='required' needs at least one tool", field="tool_choice")
        return "none", []
    return tool_choice, list(tools)


class GrammarBuilder:
    """Collects rules for one format grammar; each tool's argument grammar is embedded under a prefix."""

    def __init__(self, strict: bool, whitespace: str) -> None:
        self.rules: list[tuple[str, Expr]] = []
        # What the lowering of the tools' parameter schemas ignored, each prefixed with the tool's name.
        self.warnings: list[str] = []
        self.strict = strict
        self.whitespace = whitespace

    def add(self, name: str, expr: Expr) -> Ref:
        """Define rule ``name``; returns a reference to it."""
        self.rules.append((name, expr))
        return Ref(name)

    def arguments(self, index: int, tool: Tool) -> Ref:
        """A reference to the rule of JSON text valid for ``tool``'s parameters."""
        # Arguments are generated, so numbers follow the request policy (structured.REQUEST_NUMBERS).
        g = Grammar.from_json_schema(
            tool.parameters,
            strict=self.strict and tool.strict,
            whitespace=self.whitespace,
            numbers=REQUEST_NUMBERS,
        )
        renamed, root = g.prefixed(f"t{index}-")
        self.rules.extend(renamed)
        self.warnings.extend(f"tool {tool.name!r}: {w}" for w in g.warnings)
        return Ref(root)

    def call_members(self, tools: Sequence[Tool], arguments_key: str) -> Expr:
        """One alternative per tool: the members ``"name": "<tool>", "<arguments_key>": <arguments>``
        of a JSON call object, in that order (the order the formats render and stream-parse)."""
        ws = self.ws()
        return alt(
            *(
                seq(
                    lit('"name"'),
                    ws,
                    lit(":"),
                    ws,
                    lit(json.dumps(tool.name)),
                    ws,
                    lit(","),
                    ws,
                    lit(json.dumps(arguments_key)),
                    ws,
                    lit(":"),
                    ws,
                    self.arguments(i, tool),
                )
                for i, tool in enumerate(tools)
            )
        )

    def ws(self) -> Expr:
        """Optional whitespace between envelope tokens, as loose as the argument JSON's."""
        return Empty() if self.whitespace == "compact" else Repeat(chars(" \t\n"), 0, 2)

    def text_without(self, marker: str, name: str = "text") -> Ref:
        """Any text not containing ``marker`` (a KMP automaton, one rule per matched-prefix state)."""
        n = len(marker)
        special = sorted(set(marker))
        for k in range(n):
            options: list[Expr] = [Empty(), seq(chars("".join(special), negated=True), Ref(f"{name}-0"))]
            for c in special:
                nxt = _kmp_next(marker, k, c)
                if nxt < n:
                    options.append(seq(lit(c), Ref(f"{name}-{nxt}")))
            self.add(f"{name}-{k}", alt(*options))
        return Ref(f"{name}-0")

    def text_not_starting(self, prefixes: Sequence[str], name: str = "text") -> Ref:
        """Any text that does not begin with one of ``prefixes`` (a trie walk, then anything)."""
        anything = self.add(f"{name}-any", Repeat(chars("\x00-\U0010ffff"), 0, None))

        def node(path: str) -> Expr:
            nexts = sorted({p[len(path)] for p in prefixes if p.startswith(path) and len(p) > len(path)})
            options: list[Expr] = [Empty(), seq(chars("".join(nexts), negated=True), anything)]
            for c in nexts:
                if path + c not in prefixes:
                    options.append(seq(lit(c), node(path + c)))
            return alt(*options)

        return self.add(name, node(""))

    def build(self, root: Expr) -> Grammar:
        """The grammar of ``root`` over the rules collected so far."""
        return Grammar((("root", root), *self.rules), "root", tuple(dict.fromkeys(self.warnings)))


def _kmp_next(marker: str, k: int, c: str) -> int:
    """The KMP automaton: matched-prefix length after reading ``c`` having matched ``k`` characters."""
    while True:
        if marker[k] == c:
            return k + 1
        if k == 0:
            return 0
        k = max(j for j in range(k) if marker[:k].endswith(marker[:j]))


def repeat_calls(call: Expr, sep: Expr, parallel: bool) -> Expr:
    """One call, or with ``parallel`` one or more separated by ``sep``."""
    return seq(call, Repeat(seq(sep, call), 0, None)) if parallel else call
