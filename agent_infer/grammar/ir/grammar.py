"""The :class:`Grammar`: an immutable, ordered set of named IR rules with its root, its
constructors from every front end, and the built-in grammar files. Re-exported by
:mod:`agent_infer.grammar.ir`.

The IR imports no front end: ``Grammar.from_regex``, ``from_json_schema`` and ``from_ebnf`` call the
builder a front end registered under that name (:func:`register_frontend`), which
:mod:`agent_infer.grammar.frontends` does for every front end when ``agent_infer.grammar`` is
imported.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.ir.constructors import alt, lit, seq
from agent_infer.grammar.ir.nodes import (
    Alt,
    BoundedString,
    Check,
    Expr,
    KeyNode,
    KeySet,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
    _set,
)
from agent_infer.grammar.ir.printer import _fmt
from agent_infer.grammar.ir.references import first_undefined_ref

if TYPE_CHECKING:
    from pydantic import BaseModel

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
# Names joined by NUL all match _NAME_RE when this matches (NUL is in no valid name).
_NAMES_RE = re.compile(r"[A-Za-z0-9_-]+(?:\x00[A-Za-z0-9_-]+)*\Z")

FRONTENDS = ("regex", "json_schema", "gbnf", "lark")
"""The names front ends register builders under."""
_BUILDERS: dict[str, Callable[..., Grammar]] = {}


def register_frontend(name: str, build: Callable[..., Grammar]) -> None:
    """Make ``build`` the front end ``Grammar.from_*`` calls for ``name`` (one of :data:`FRONTENDS`)."""
    if name not in FRONTENDS:
        raise ValueError(f"unknown front end {name!r}; expected one of {', '.join(FRONTENDS)}")
    _BUILDERS[name] = build


def _frontend(name: str) -> Callable[..., Grammar]:
    build = _BUILDERS.get(name)
    if build is None:
        raise GrammarDefinitionError(
            f"the {name} front end is not registered (import agent_infer.grammar, which registers them)"
        )
    return build


@dataclass(frozen=True)
class Grammar:
    """An immutable grammar: ordered ``rules`` (name, expr) and the ``root`` rule's name.

    ``warnings`` lists constraints a non-strict front end could not enforce (e.g. ignored JSON
    Schema keywords with their pointers); they surface as ``CompiledGrammar.warnings``.
    """

    rules: tuple[tuple[str, Expr], ...]
    root: str = "root"
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # The root always comes first, so equality does not depend on how rules were listed
        # and ``parse_gbnf(str(g)) == g`` holds (str prints the root first).
        ordered = tuple(sorted(self.rules, key=lambda r: r[0] != self.root))
        if ordered != self.rules:
            object.__setattr__(self, "rules", ordered)
        names = [name for name, _ in self.rules]
        seen: set[str] = set(names)
        # One regex pass over all names; only when it fails (or a name repeats) does the per-name
        # loop run, which reports the first offending name in rule order.
        if len(seen) != len(names) or not _NAMES_RE.match("\x00".join(names)):
            seen = set()
            for name in names:
                if not _NAME_RE.match(name):
                    raise GrammarDefinitionError(
                        f"invalid rule name {name!r} (use letters, digits, '_' and '-')"
                    )
                if name in seen:
                    raise GrammarDefinitionError(f"rule {name!r} is defined twice")
                seen.add(name)
        if self.root not in seen:
            raise GrammarDefinitionError(f"root rule {self.root!r} is not defined")
        found = first_undefined_ref(self.rules, seen)
        if found is not None:
            raise GrammarDefinitionError(f"rule {found[0]!r} refers to undefined rule {found[1]!r}")

    @classmethod
    def unchecked(
        cls, rules: tuple[tuple[str, Expr], ...], root: str = "root", warnings: tuple[str, ...] = ()
    ) -> Grammar:
        """A grammar from a front end whose rules are well formed by construction (valid distinct
        names, the root first, every reference defined), without the validation walk over every
        node: a large JSON Schema grammar holds ~10^5 nodes that the serializer walks anyway, and it
        reports an undefined reference as GrammarDefinitionError when the grammar is compiled.
        Anything else goes through the validating constructor."""
        if not rules or rules[0][0] != root:
            return cls(rules, root, warnings)
        grammar = object.__new__(cls)
        _set(grammar, "rules", rules)
        _set(grammar, "root", root)
        _set(grammar, "warnings", warnings)
        return grammar

    # -- access --

    @property
    def rule_map(self) -> dict[str, Expr]:
        """Rules as a dict (insertion-ordered)."""
        return dict(self.rules)

    def rule(self, name: str) -> Expr:
        """The expression of rule ``name``."""
        for rule_name, expr in self.rules:
            if rule_name == name:
                return expr
        raise KeyError(name)

    def prefixed(self, prefix: str) -> tuple[tuple[tuple[str, Expr], ...], str]:
        """The rules renamed ``prefix + name`` (references too) and the renamed root: the pieces to
        embed this grammar inside another one without name clashes."""
        mapping = {name: f"{prefix}{name}" for name, _ in self.rules}
        return tuple((mapping[name], _rename(expr, mapping)) for name, expr in self.rules), mapping[self.root]

    def fingerprint(self) -> str:
        """A stable hash of the printed grammar (computed once per instance: grammars are immutable)."""
        cached: str | None = getattr(self, "_fingerprint", None)
        if cached is None:
            cached = hashlib.sha256(f"{self.root}\n{self}".encode()).hexdigest()
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def __str__(self) -> str:
        return "\n".join(f"{name} ::= {_fmt(expr, 0)}" for name, expr in self.rules) + "\n"

    # -- construction --

    @classmethod
    def from_rules(
        cls, rules: Mapping[str, Expr] | Iterable[tuple[str, Expr]], root: str = "root"
    ) -> Grammar:
        """Build from a mapping or pairs of rule name -> expression."""
        items = tuple(rules.items()) if isinstance(rules, Mapping) else tuple(rules)
        return cls(items, root)

    @classmethod
    def from_expr(cls, expr: Expr) -> Grammar:
        """A grammar whose only rule, ``root``, is ``expr``."""
        return cls((("root", expr),), "root")

    @classmethod
    def from_regex(cls, pattern: str) -> Grammar:
        """Python ``re`` syntax, matched in full. Lookarounds and backreferences raise UnsupportedRegexError."""
        return _frontend("regex")(pattern)

    @classmethod
    def from_json_schema(
        cls,
        schema: dict[str, Any] | str | type[BaseModel] | bool,
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
        """JSON Schema (dict, JSON text, or a Pydantic model class) to a grammar of conforming JSON.

        ``whitespace``: ``"compact"`` (no optional whitespace) or ``"flexible"`` (at most
        ``max_whitespace`` whitespace characters at each optional spot). ``indent`` pins a layout.
        In strict mode an unenforceable keyword raises UnsupportedSchemaError. ``remotes`` maps
        absolute URIs to documents that ``$ref`` may point into (nothing is fetched).
        An unknown ``format`` value or keyword is an annotation (a ``warnings`` entry with its
        pointer) unless ``unknown_formats`` / ``unknown_keywords`` is ``"error"``.
        ``numbers="float64"`` limits the digits of numbers the schema leaves open to what float64
        and 64-bit integers hold; ``"exact"`` (default) keeps them unbounded.
        """
        return _frontend("json_schema")(
            schema,
            strict=strict,
            whitespace=whitespace,
            max_whitespace=max_whitespace,
            indent=indent,
            remotes=remotes,
            unknown_formats=unknown_formats,
            unknown_keywords=unknown_keywords,
            numbers=numbers,
        )

    @classmethod
    def from_ebnf(cls, text: str, *, syntax: str = "gbnf", start: str | None = None) -> Grammar:
        """An EBNF grammar in llama.cpp's GBNF (``syntax="gbnf"``, start ``root``) or Lark (start ``start``)."""
        if syntax == "gbnf":
            return _frontend("gbnf")(text, start=start or "root")
        if syntax == "lark":
            return _frontend("lark")(text, start=start or "start")
        raise GrammarDefinitionError(f"unknown EBNF syntax {syntax!r}; expected 'gbnf' or 'lark'")

    @classmethod
    def builtin(cls, name: str) -> Grammar:
        """Load ``grammars/NAME.gbnf`` or ``grammars/NAME.lark`` shipped with agent-infer."""
        path = builtin_grammar_path(name)
        syntax = "lark" if path.suffix == ".lark" else "gbnf"
        return cls.from_ebnf(path.read_text(encoding="utf-8"), syntax=syntax)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of the given strings."""
        if not options:
            raise GrammarDefinitionError("choice needs at least one option")
        return cls.from_expr(alt(*(lit(o) for o in options)))

    @classmethod
    def union(cls, *grammars: Grammar) -> Grammar:
        """Strings of any one of ``grammars``."""
        return _combine(grammars, alt)

    @classmethod
    def concat(cls, *grammars: Grammar) -> Grammar:
        """A string of each of ``grammars`` in order."""
        return _combine(grammars, seq)


def _rename(expr: Expr, mapping: Mapping[str, str]) -> Expr:
    if isinstance(expr, KeySet | KeyNode):
        # Key tries call rules by fixed names: renamed, one is the alternation it expands to.
        return Alt(tuple(_rename(e, mapping) for e in expr.expand()))
    if isinstance(expr, Ref):
        return Ref(mapping[expr.name])
    if isinstance(expr, Check):
        return Check(
            tuple(Ref(mapping[r.name]) for r in expr.items), expr.carriers, expr.accept, expr.product
        )
    if isinstance(expr, Seq):
        return Seq(tuple(_rename(e, mapping) for e in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(_rename(e, mapping) for e in expr.items))
    if isinstance(expr, Repeat):
        return Repeat(_rename(expr.item, mapping), expr.min, expr.max)
    if isinstance(expr, UniqueItem):
        return UniqueItem(_rename(expr.item, mapping))
    if isinstance(expr, BoundedString):
        return BoundedString(_rename(expr.item, mapping), expr.max_length)
    return expr


def _combine(grammars: Sequence[Grammar], join: Any) -> Grammar:
    if not grammars:
        raise GrammarDefinitionError("union/concat needs at least one grammar")
    rules: list[tuple[str, Expr]] = []
    roots: list[Expr] = []
    warnings: list[str] = []
    for i, g in enumerate(grammars):
        renamed, root = g.prefixed(f"g{i}-")
        rules.extend(renamed)
        roots.append(Ref(root))
        warnings.extend(g.warnings)
    return Grammar((("root", join(*roots)), *rules), "root", tuple(warnings))


def grammars_dir() -> Path:
    """Where built-in grammar files live: the checkout's ``grammars/`` or the installed package data."""
    here = Path(__file__).resolve().parents[2]
    for candidate in (here.parent / "grammars", here / "grammars_data"):
        if candidate.is_dir():
            return candidate
    raise GrammarDefinitionError(f"built-in grammars folder not found next to {here}")


def builtin_grammar_path(name: str) -> Path:
    """The file of built-in grammar ``name``; the error lists the available names."""
    folder = grammars_dir()
    for suffix in (".gbnf", ".lark"):
        path = folder / f"{name}{suffix}"
        if _NAME_RE.match(name) and path.is_file():
            return path
    available = sorted(p.stem for p in folder.iterdir() if p.suffix in (".gbnf", ".lark"))
    raise GrammarDefinitionError(f"no built-in grammar {name!r}; available: {', '.join(available)}")
