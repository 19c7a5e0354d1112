"""Printing IR expressions as GBNF (llama.cpp's dialect, plus ``_`` in names): what
``str(grammar)`` shows and the GBNF front end reads back."""

from __future__ import annotations

from agent_infer.grammar.ir_nodes import Alt, CharClass, Empty, Expr, Literal, Ref, Repeat, Seq


def _escape_char(cp: int, in_class: bool) -> str:
    special = {0x5C: "\\\\", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
    if cp in special:
        return special[cp]
    if in_class and chr(cp) in "][":
        return "\\" + chr(cp)
    if in_class and chr(cp) in "-^":
        return f"\\x{cp:02X}"  # llama.cpp rejects \- and \^ inside classes
    if not in_class and cp == 0x22:
        return '\\"'
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02X}"
    if 0xD800 <= cp <= 0xDFFF or cp in (0x2028, 0x2029) or (0x80 <= cp <= 0x9F):
        return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"
    if cp > 0xFFFF and not chr(cp).isprintable():
        return f"\\U{cp:08X}"
    return chr(cp)


def _fmt(expr: Expr, prec: int) -> str:
    """Format with precedence: 0 = alternation, 1 = sequence, 2 = atom."""
    if isinstance(expr, Empty):
        return '""'
    if isinstance(expr, Literal):
        return '"' + "".join(_escape_char(ord(c), False) for c in expr.text) + '"'
    if isinstance(expr, CharClass):
        body = "".join(
            _escape_char(lo, True) if lo == hi else f"{_escape_char(lo, True)}-{_escape_char(hi, True)}"
            for lo, hi in expr.ranges
        )
        return f"[{'^' if expr.negated else ''}{body}]"
    if isinstance(expr, Ref):
        return expr.name
    if isinstance(expr, Seq):
        text = " ".join(_fmt(item, 2 if isinstance(item, Alt | Seq) else 1) for item in expr.items)
        return f"({text})" if prec >= 2 else text
    if isinstance(expr, Alt):
        if not expr.items:
            return "[^\\x00-\\U0010FFFF]"  # a class that matches nothing: the empty language
        text = " | ".join(_fmt(item, 1) for item in expr.items)
        return f"({text})" if prec >= 1 else text
    if isinstance(expr, Repeat):
        inner = _fmt(expr.item, 2)
        if isinstance(expr.item, Repeat):
            inner = f"({inner})"
        lo, hi = expr.min, expr.max
        if (lo, hi) == (0, None):
            return inner + "*"
        if (lo, hi) == (1, None):
            return inner + "+"
        if (lo, hi) == (0, 1):
            return inner + "?"
        if hi is None:
            return f"{inner}{{{lo},}}"
        if lo == hi:
            return f"{inner}{{{lo}}}"
        return f"{inner}{{{lo},{hi}}}"
    raise TypeError(f"not an IR node: {expr!r}")
