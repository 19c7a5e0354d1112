"""Docstring parsing for tool descriptions: the summary and per-parameter text of Google, numpy
and Sphinx style docstrings."""

from __future__ import annotations

import inspect
import re

__all__ = ["parse_docstring"]

_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|Notes?|See Also|Attributes)\s*:?\s*$"
)
_GOOGLE_ITEM_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NUMPY_ITEM_RE = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*(?::.*)?$")
_SPHINX_RE = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) from a Google, numpy or Sphinx style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    in_sections = False  # prose after the first section belongs to that section, not the summary
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        numpy_header = i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x")
        if _SPHINX_RE.match(stripped) or stripped.startswith((":return", ":raises", ":rtype", ":type")):
            in_sections = True
            i = _sphinx_block(lines, i, params)
        elif _SECTION_RE.match(stripped) and (numpy_header or stripped.endswith(":")):
            name = stripped.rstrip(":").strip()
            is_params = name in ("Args", "Arguments", "Parameters", "Params", "Keyword Args")
            in_sections = True
            if numpy_header:
                i = _numpy_block(lines, i + 2, params if is_params else {})
            else:
                i = _google_block(lines, i + 1, params if is_params else {})
        else:
            if not in_sections:
                summary.append(line)
            i += 1
    return "\n".join(summary).strip(), params


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _google_block(lines: list[str], i: int, out: dict[str, str]) -> int:
    base: int | None = None
    current: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.strip() and _indent(line) == 0:
            break  # the next section (or summary text) starts at column 0
        if line.strip():
            base = _indent(line) if base is None else base
            m = _GOOGLE_ITEM_RE.match(line.strip())
            if _indent(line) <= base and m:
                current = m.group(1).lstrip("*")
                out[current] = m.group(2).strip()
            elif current is not None:
                out[current] = f"{out[current]} {line.strip()}".strip()
        i += 1
    return i


def _numpy_block(lines: list[str], i: int, out: dict[str, str]) -> int:
    current: list[str] = []  # "x, y : int" describes both names at once
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x"):
            break  # the next numpy section header
        if line.strip():
            m = _NUMPY_ITEM_RE.match(line.strip())
            if _indent(line) == 0 and m:
                current = re.split(r"\s*,\s*", m.group(1))
                out.update((name, "") for name in current)
            else:
                for name in current:
                    out[name] = f"{out[name]} {line.strip()}".strip()
        i += 1
    return i


def _sphinx_block(lines: list[str], i: int, out: dict[str, str]) -> int:
    m = _SPHINX_RE.match(lines[i].strip())
    i += 1
    text = m.group(2).strip() if m else ""
    while (
        i < len(lines) and lines[i].strip() and _indent(lines[i]) > 0 and not lines[i].strip().startswith(":")
    ):
        text = f"{text} {lines[i].strip()}"
        i += 1
    if m:
        out[m.group(1)] = text
    return i
