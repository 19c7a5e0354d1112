"""``format`` values as decoded-string expressions (wrapped by :func:`encode_expr` for JSON text).

Formats are treated as assertions (see docs/json_schema.md). Dates are exact per RFC 3339,
including month lengths and Gregorian leap years; a leap second (``:60``) is accepted only at
23:59 UTC written with ``Z`` or a zero offset. ``hostname`` checks label syntax, label lengths and
the 253-character total, and refuses A-labels (``xn--``); ``uri``/``uri-reference`` check RFC 3986 character classes and
the scheme, not every production. A format's expression, JSON encoding and automaton are built
once per process (:func:`format_expr`, :func:`encoded_format`, :func:`format_dfa`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent_infer.grammar.automata import DFA, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.types import numerals as num
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_expr
from agent_infer.grammar.ir import Expr, Repeat, alt, chars, lit, opt, plus, seq, star

DIGIT = chars("0-9")
HEXDIG = chars("0-9a-fA-F")
ALPHA = chars("a-zA-Z")
ALNUM = chars("a-zA-Z0-9")


def _two(lo: int, hi: int) -> Expr:
    return alt(*(lit(f"{v:02d}") for v in range(lo, hi + 1)))


def full_date() -> Expr:
    """YYYY-MM-DD with real month lengths; Feb 29 only in leap years."""
    year = Repeat(DIGIT, 4, 4)
    d28 = _two(1, 28)
    thirty_one = alt(*(lit(m) for m in ("01", "03", "05", "07", "08", "10", "12")))
    thirty = alt(*(lit(m) for m in ("04", "06", "09", "11")))
    common = seq(
        year,
        lit("-"),
        alt(
            seq(thirty_one, lit("-"), alt(d28, lit("29"), lit("30"), lit("31"))),
            seq(thirty, lit("-"), alt(d28, lit("29"), lit("30"))),
            seq(lit("02-"), d28),
        ),
    )
    # Leap years: divisible by 4, except centuries not divisible by 400.
    yy4 = alt(*(lit(f"{v:02d}") for v in range(4, 100, 4)))
    cc4 = alt(*(lit(f"{v:02d}") for v in range(0, 100, 4)))
    leap_year = alt(seq(DIGIT, DIGIT, yy4), seq(cc4, lit("00")))
    return alt(common, seq(leap_year, lit("-02-29")))


def _offset() -> Expr:
    return alt(chars("Zz"), seq(chars("+-"), _two(0, 23), lit(":"), _two(0, 59)))


def full_time() -> Expr:
    """HH:MM:SS[.frac](Z|±HH:MM); leap second only at 23:59:60 UTC."""
    frac = opt(seq(lit("."), plus(DIGIT)))
    normal = seq(_two(0, 23), lit(":"), _two(0, 59), lit(":"), _two(0, 59), frac, _offset())
    leap = seq(lit("23:59:60"), frac, alt(chars("Zz"), seq(chars("+-"), lit("00:00"))))
    return alt(normal, leap)


def date_time() -> Expr:
    """RFC 3339 date-time (``T`` and ``Z`` in either case)."""
    return seq(full_date(), chars("Tt"), full_time())


def duration() -> Expr:
    """ISO 8601 duration as in the JSON Schema appendix (no fractions, no mixing weeks)."""
    n = plus(DIGIT)
    second = seq(n, lit("S"))
    minute = seq(n, lit("M"), opt(second))
    hour = seq(n, lit("H"), opt(minute))
    time = seq(lit("T"), alt(hour, minute, second))
    day = seq(n, lit("D"))
    month = seq(n, lit("M"), opt(day))
    year = seq(n, lit("Y"), opt(month))
    date = seq(alt(day, month, year), opt(time))
    return seq(lit("P"), alt(date, time, seq(n, lit("W"))))


def ipv4() -> Expr:
    """Dotted quad, octets 0-255 without leading zeros."""
    octet = alt(
        DIGIT,
        seq(chars("1-9"), DIGIT),
        seq(lit("1"), DIGIT, DIGIT),
        seq(lit("2"), chars("0-4"), DIGIT),
        seq(lit("25"), chars("0-5")),
    )
    return seq(octet, Repeat(seq(lit("."), octet), 3, 3))


def ipv6() -> Expr:
    """RFC 4291 text form (RFC 3986 ``IPv6address``), including ``::`` and embedded IPv4."""
    h16 = Repeat(HEXDIG, 1, 4)
    h16c = seq(h16, lit(":"))
    ls32 = alt(seq(h16, lit(":"), h16), ipv4())

    def upto(k: int) -> Expr:
        # [ *k( h16 ":" ) h16 ]
        return opt(seq(Repeat(h16c, 0, k), h16)) if k >= 0 else lit("")

    return alt(
        seq(Repeat(h16c, 6, 6), ls32),
        seq(lit("::"), Repeat(h16c, 5, 5), ls32),
        seq(opt(h16), lit("::"), Repeat(h16c, 4, 4), ls32),
        seq(upto(1), lit("::"), Repeat(h16c, 3, 3), ls32),
        seq(upto(2), lit("::"), Repeat(h16c, 2, 2), ls32),
        seq(upto(3), lit("::"), h16c, ls32),
        seq(upto(4), lit("::"), ls32),
        seq(upto(5), lit("::"), h16),
        seq(upto(6), lit("::")),
    )


def _ldh_label() -> Expr:
    """1-63 letters, digits and inner hyphens (RFC 1123)."""
    return seq(ALNUM, opt(seq(Repeat(chars("a-zA-Z0-9-"), 0, 61), ALNUM)))


def hostname() -> Expr:
    """Dot-separated labels of 1-63 letters, digits and inner hyphens, none with ``--`` in its
    third and fourth characters: RFC 5891 reserves those for A-labels (``xn--``), whose Punycode
    and IDNA rules no grammar decides, so they are refused rather than let through unchecked.
    The 253-character total is :data:`FORMAT_MAX_LENGTH`'s, counted like a ``maxLength``."""
    ldh = chars("a-zA-Z0-9-")
    short = seq(ALNUM, opt(seq(Repeat(ldh, 0, 2), ALNUM)))  # 1-4 characters: no room for ``??--``
    third_fourth = alt(seq(ALNUM, ldh), seq(lit("-"), ALNUM))
    long = seq(ALNUM, ldh, third_fourth, Repeat(ldh, 0, 58), ALNUM)  # 5-63 characters
    label = alt(short, long)
    return seq(label, star(seq(lit("."), label)))


def email() -> Expr:
    """RFC 5321 mailbox: dot-atom or quoted local part; hostname or bracketed IP domain."""
    atext = chars("a-zA-Z0-9!#$%&'*+/=?^_`{|}~-")
    dot_atom = seq(plus(atext), star(seq(lit("."), plus(atext))))
    qtext = chars(" !#-[]-~")
    quoted = seq(lit('"'), star(alt(qtext, seq(lit("\\"), chars(" -~")))), lit('"'))
    domain = alt(
        seq(_ldh_label(), star(seq(lit("."), _ldh_label()))),
        seq(lit("["), ipv4(), lit("]")),
        seq(lit("[IPv6:"), ipv6(), lit("]")),
    )
    return seq(alt(dot_atom, quoted), lit("@"), domain)


def uuid() -> Expr:
    """8-4-4-4-12 hex digits."""
    return seq(
        *(
            x
            for i, k in enumerate((8, 4, 4, 4, 12))
            for x in ((lit("-"),) if i else ()) + (Repeat(HEXDIG, k, k),)
        )
    )


_UNRESERVED = "a-zA-Z0-9._~"
_SUB_DELIMS = "!$&'()*+,;="


def _uri_parts() -> dict[str, Expr]:
    """RFC 3986 pieces: authority, paths, query, fragment."""
    pct = seq(lit("%"), HEXDIG, HEXDIG)
    pchar = alt(chars(_UNRESERVED + _SUB_DELIMS + ":@-"), pct)
    userinfo = seq(star(alt(chars(_UNRESERVED + _SUB_DELIMS + ":-"), pct)), lit("@"))
    future = seq(chars("vV"), plus(HEXDIG), lit("."), plus(chars(_UNRESERVED + _SUB_DELIMS + ":-")))
    host = alt(
        seq(lit("["), alt(ipv6(), future), lit("]")), star(alt(chars(_UNRESERVED + _SUB_DELIMS + "-"), pct))
    )
    abempty = star(seq(lit("/"), star(pchar)))
    return {
        "authority": seq(lit("//"), opt(userinfo), host, opt(seq(lit(":"), star(DIGIT))), abempty),
        "absolute": seq(lit("/"), opt(seq(plus(pchar), abempty))),
        "rootless": seq(plus(pchar), abempty),
        "noscheme": seq(plus(alt(chars(_UNRESERVED + _SUB_DELIMS + "@-"), pct)), abempty),
        "tail": seq(
            opt(seq(lit("?"), star(alt(pchar, chars("/?"))))),
            opt(seq(lit("#"), star(alt(pchar, chars("/?"))))),
        ),
    }


def uri() -> Expr:
    """Absolute URI: ``scheme:`` hier-part, query, fragment (RFC 3986 section 3)."""
    p = _uri_parts()
    scheme = seq(ALPHA, star(chars("a-zA-Z0-9+.-")))
    return seq(scheme, lit(":"), alt(p["authority"], p["absolute"], p["rootless"], lit("")), p["tail"])


def uri_reference() -> Expr:
    """A URI or a relative reference (first path segment without ``:``)."""
    p = _uri_parts()
    relative = seq(alt(p["authority"], p["absolute"], p["noscheme"], lit("")), p["tail"])
    return alt(uri(), relative)


FORMATS: dict[str, Callable[[], Expr]] = {
    "date": full_date,
    "time": full_time,
    "date-time": date_time,
    "duration": duration,
    "email": email,
    "hostname": hostname,
    "ipv4": ipv4,
    "ipv6": ipv6,
    "uuid": uuid,
    "uri": uri,
    "uri-reference": uri_reference,
}


# Formats whose text has a length bound the expression leaves out (a product with the label
# structure would multiply its states): applied as a ``maxLength`` (types/strings.py).
FORMAT_MAX_LENGTH: dict[str, int] = {"hostname": 253}


# Extra formats that are cheap to state exactly.
_JSON_POINTER = star(seq(lit("/"), star(alt(chars("~/", negated=True), seq(lit("~"), chars("01"))))))
EXTRA_FORMATS = {
    "json-pointer": lambda: _JSON_POINTER,
    "relative-json-pointer": lambda: seq(num.uint_range(0, None), alt(lit("#"), _JSON_POINTER)),
}


# The formats draft 2020-12 defines (validation, section 7.3; draft-07 defines the same names).
# One of these without an expression here is a constraint the front end cannot enforce (refused
# in strict mode); any other name is an unknown format, an annotation (section 7.2).
SPEC_FORMATS = frozenset(
    (
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "idn-email",
        "hostname",
        "idn-hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "iri",
        "iri-reference",
        "uuid",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
    )
)


# Format expressions, their JSON encodings and automata depend on the format's name alone, from a
# fixed table (a date-time expression is ~2 000 IR nodes, its encoding more): library constants,
# built at first use and kept for the process like the JSON character rules, not memos of earlier
# schemas (so clear_grammar_caches leaves them). Only names in the table are ever stored.
_FORMAT_EXPRS: dict[str, Expr] = {}
_ENCODED_FORMATS: dict[str, Expr] = {}
_FORMAT_DFAS: dict[str, DFA] = {}


def format_expr(name: str) -> Expr | None:
    """The decoded-string expression of format ``name`` (built once), or None for an unknown one."""
    found = _FORMAT_EXPRS.get(name)
    if found is None:
        make = FORMATS.get(name) or EXTRA_FORMATS.get(name)
        if make is None:
            return None
        found = _FORMAT_EXPRS.setdefault(name, make())
    return found


def encoded_format(name: str) -> Expr:
    """The JSON encoding of a known format's expression (built once)."""
    found = _ENCODED_FORMATS.get(name)
    if found is None:
        expr = format_expr(name)
        assert expr is not None  # only called for known formats
        found = _ENCODED_FORMATS.setdefault(name, encode_expr(expr))
    return found


def format_dfa(name: str) -> DFA:
    """The automaton of a known format's expression (built once)."""
    # DFAs are only read once built (their cached live set is a pure function of them).
    found = _FORMAT_DFAS.get(name)
    if found is None:
        expr = format_expr(name)
        assert expr is not None
        found = _FORMAT_DFAS.setdefault(name, expr_to_dfa(expr))
    return found


def is_unknown_format(name: Any) -> bool:
    """Whether ``name`` is a format the specification does not define and the front end does not
    implement: an annotation, which constrains nothing."""
    return isinstance(name, str) and name not in SPEC_FORMATS and format_expr(name) is None
