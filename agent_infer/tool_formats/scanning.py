"""Scanning model output into pieces (text, or a call's name and raw argument JSON).

Shared by whole-text parsing and the stream parser of every format, which is what makes both agree.
A ``Layout`` matches a call's syntax step by step and tells "matched" from "may still match"
from "cannot match", so a partial output is never misread as text or as a finished call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Piece:
    """A scanned part of the output: text (``is_call`` false) or a call, finished or not."""

    is_call: bool
    text: str = ""
    name: str | None = None
    arguments: str = ""
    complete: bool = False
    # Set where the scanner is back at top level after this piece: a later scan may start there.
    resume: int | None = None


# --- assembling pieces -----------------------------------------------------------------------------


def assemble(pieces: Sequence[Piece], final: bool = True) -> tuple[str, list[Piece]]:
    """Content and call pieces. Whitespace right before a call, or alone after one, is not content.

    Not ``final``: trailing whitespace is held back, since a call may still follow it.
    """
    merged = merge_text(pieces)
    content: list[str] = []
    for i, p in enumerate(merged):
        if p.is_call:
            continue
        text = p.text
        if i > 0 and not text.strip():
            text = ""  # only whitespace after a call: layout, not content
        if i + 1 < len(merged) or not final:
            text = text.rstrip()
        content.append(text)
    return "".join(content), [p for p in merged if p.is_call]


def merge_text(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent text pieces joined into one (keeping the later resume point)."""
    merged: list[Piece] = []
    for p in pieces:
        if not p.is_call and merged and not merged[-1].is_call:
            merged[-1] = Piece(False, merged[-1].text + p.text, resume=p.resume)
        else:
            merged.append(p)
    return merged


# --- scanning helpers ------------------------------------------------------------------------------

_WS = re.compile(r"\s*")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|[^"{}\[\]]+', re.DOTALL)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (may start one)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def text_until(text: str, pos: int, marker: str, final: bool) -> tuple[int, Piece]:
    """The plain text from ``pos`` to the next ``marker``: (marker index, text piece).

    The index is -1 when no marker follows; then, unless ``final``, a tail that could still grow
    into the marker is held back and the piece records where the next scan resumes.
    """
    k = text.find(marker, pos)
    if k >= 0:
        return k, Piece(False, text[pos:k])
    seg = text[pos:]
    if not final:
        seg = seg[: len(seg) - held_back(seg, [marker])]
    return -1, Piece(False, seg, resume=pos + len(seg))


def scan_object(text: str, pos: int) -> int | None:
    """End of the JSON object starting at ``pos``; None if it is unfinished; -1 if none starts there."""
    if not text.startswith("{", pos):
        return -1 if pos < len(text) else None
    depth = 0
    i = pos
    while i < len(text):
        m = _JSON_TOKEN.match(text, i)
        if m is None:  # an unterminated string
            return None
        tok = m.group()
        if tok in ("{", "["):
            depth += 1
        elif tok in ("}", "]"):
            depth -= 1
            if depth == 0:
                return m.end()
        i = m.end()
    return None


class Layout:
    """Matches a call's syntax step by step, telling "matched" from "may still match" from "cannot".

    Steps: a literal (or tuple of alternatives), ``WS`` (optional whitespace), ``NAME_STR`` (a JSON
    string holding the name), ``("until", stop)`` (a raw name ending before ``stop``) and ``ARGS``
    (a JSON object).
    """

    WS = "\x00ws"
    NAME_STR = "\x00str"
    ARGS = "\x00args"

    def __init__(self, *steps: Any) -> None:
        self.steps = steps

    def match(self, text: str, pos: int, final: bool) -> tuple[str, int, str | None, str]:
        """(status "ok"/"partial"/"fail", end, name, raw arguments so far)."""
        name: str | None = None
        args = ""
        for step in self.steps:
            if step == Layout.WS:
                pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
                continue
            rest = text[pos:]
            if step == Layout.NAME_STR:
                m = _JSON_STRING.match(text, pos)
                if m is None:
                    viable = not final and (not rest or rest.startswith('"'))
                    return ("partial" if viable else "fail", pos, name, args)
                name = json.loads(m.group())
                pos = m.end()
            elif step == Layout.ARGS:
                end = scan_object(text, pos)
                if end is None:
                    return ("fail" if final else "partial", pos, name, rest)
                if end < 0:
                    return "fail", pos, name, args
                args = text[pos:end]
                pos = end
            elif isinstance(step, tuple) and step[0] == "until":
                stop = text.find(step[1], pos)
                if stop < 0:
                    return ("fail" if final else "partial", pos, name, args)
                name = text[pos:stop]
                pos = stop
            else:
                options = step if isinstance(step, tuple) else (step,)
                hit = next((o for o in options if rest.startswith(o)), None)
                if hit is None:
                    viable = not final and any(o.startswith(rest) for o in options)
                    return ("partial" if viable else "fail", pos, name, args)
                pos += len(hit)
        return "ok", pos, name, args


def call_piece(status: str, name: str | None, args: str) -> Piece | None:
    """The piece of a matched or partial call; None when it did not match (or its JSON is invalid)."""
    if status == "fail":
        return None
    if status == "ok":
        try:
            valid = isinstance(json.loads(args), dict)
        except json.JSONDecodeError:
            valid = False
        return Piece(True, name=name, arguments=args, complete=True) if valid else None
    return Piece(True, name=name, arguments=args if name is not None else "")
