"""The layout of the JSON texts a grammar accepts: whitespace, separators and container brackets,
either flexible (optional blanks and newlines at every spot JSON allows them) or pinned (the
exact text ``json.dumps(indent=N)`` writes)."""

from __future__ import annotations

from agent_infer.grammar.ir import Empty, Expr, Ref, Repeat, alt, chars, lit, seq

# After a newline, flexible whitespace allows this much indentation (json.dumps(indent=2) to depth 20).
MAX_LINE_INDENT = 40


class Layout:
    """The layout half of the :class:`~agent_infer.grammar.frontends.json_schema.compiler.Compiler`:
    ``indent`` pins the layout (None: flexible), ``rules`` gets the shared ``ws`` rule."""

    rules: dict[str, Expr]
    indent: int | None

    def set_layout(self, whitespace: str, max_whitespace: int) -> None:
        """Build the whitespace and separators (``self.indent`` already set)."""
        indent = self.indent
        blank = chars(" \t")
        if whitespace == "compact" or indent is not None:
            self.ws: Expr = Empty()
        else:
            self.rules["ws"] = alt(
                Repeat(blank, 0, max_whitespace),
                seq(alt(lit("\n"), lit("\r\n")), Repeat(blank, 0, max(MAX_LINE_INDENT, max_whitespace))),
            )
            self.ws = Ref("ws")
        self._colon = lit(": ") if indent is not None else seq(self.ws, lit(":"), self.ws)
        self._seps: dict[int, Expr] = {}
        self._empties: dict[str, Expr] = {}

    # -- layout --------------------------------------------------------------------------------

    def open(self, depth: int) -> Expr:
        """Whitespace after ``{``/``[`` and after ``,``."""
        return lit("\n" + " " * (self.indent * (depth + 1))) if self.indent is not None else self.ws

    def close(self, depth: int) -> Expr:
        """Whitespace before ``}``/``]``."""
        return lit("\n" + " " * (self.indent * depth)) if self.indent is not None else self.ws

    def sep(self, depth: int) -> Expr:
        """An element separator: optional whitespace, comma, whitespace (or the pinned layout)."""
        # Built once per depth (IR nodes are immutable): every member and element asks for it.
        key = depth if self.indent is not None else 0
        found = self._seps.get(key)
        if found is None:
            found = self._seps[key] = seq(self.ws, lit(","), self.open(depth))
        return found

    def colon(self) -> Expr:
        """The key/value separator."""
        return self._colon

    def container(self, open_: str, close_: str, body: Expr, nullable: bool, depth: int) -> Expr:
        """``open body close`` where ``body`` is non-empty members; the empty form if ``nullable``."""
        full = seq(lit(open_), self.open(depth), body, self.close(depth), lit(close_))
        return alt(full, self.empty(open_, close_)) if nullable else full

    def empty(self, open_: str, close_: str) -> Expr:
        """An empty container: ``{}`` (with optional blank inside in flexible mode)."""
        found = self._empties.get(open_ + close_)
        if found is None:
            found = lit(open_ + close_) if self.indent is not None else seq(lit(open_), self.ws, lit(close_))
            self._empties[open_ + close_] = found
        return found
