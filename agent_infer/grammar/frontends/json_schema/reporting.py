"""What the JSON Schema lowering cannot enforce, and what it ignores: the reporting half of the
:class:`~agent_infer.grammar.frontends.json_schema.compiler.Compiler`.

Constraints it cannot enforce fail in strict mode and are warnings otherwise. Unknown ``format``
values and unknown keywords are annotations in draft 2020-12 (core 6.5, validation 7.2), so they
are warnings in either mode, unless the caller asked for them to fail (``unknown_formats`` /
``unknown_keywords`` set to ``"error"``). Each warning names the keyword's JSON pointer.
"""

from __future__ import annotations

from agent_infer.errors import UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.keywords import _near_keyword


class Reporter:
    """Records warnings in ``warnings`` or raises, by ``strict`` and the two annotation switches."""

    strict: bool
    unknown_formats: str
    unknown_keywords: str
    warnings: list[str]

    def unsupported(self, keyword: str, pointer: str, why: str) -> None:
        """Strict: raise; non-strict: record a warning and let the caller skip the keyword."""
        if self.strict:
            raise UnsupportedSchemaError(why, keyword=keyword, pointer=pointer)
        self.warnings.append(f"ignored keyword {keyword} at {pointer or '/'}: {why}")

    def unknown_keyword(self, keyword: str, pointer: str) -> None:
        """A keyword from no JSON Schema vocabulary: an annotation, as validators treat it (2020-12
        core, section 6.5), noted in the warnings with a hint when it looks like a typo of a known
        keyword; an UnsupportedSchemaError under ``unknown_keywords="error"``."""
        near = _near_keyword(keyword)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        if self.unknown_keywords == "error":
            raise UnsupportedSchemaError(
                f"unknown keyword {keyword!r}{hint}", keyword=keyword, pointer=pointer
            )
        self.warnings.append(
            f"ignored unknown keyword {keyword} at {pointer}: treated as an annotation{hint}"
        )

    def unknown_format(self, fmt: str, pointer: str) -> None:
        """A ``format`` value the front end does not know: an annotation (2020-12 validation,
        section 7.2: an implementation ignores formats it does not know), noted in the warnings;
        an UnsupportedSchemaError under ``unknown_formats="error"``."""
        if self.unknown_formats == "error":
            raise UnsupportedSchemaError(f"unknown format {fmt!r}", keyword="format", pointer=pointer)
        self.warnings.append(f"ignored unknown format {fmt!r} at {pointer}: treated as an annotation")
