"""Reference-side helpers of the grammar fuzz suite: byte mutations, the schema validator with
ECMA-262 ``pattern`` anchoring, bounds on the pure-Python oracles (size, time) and the documented
JSON Schema policies the completeness check leaves out. Used by :mod:`fuzz_worker`."""

from __future__ import annotations

import contextlib
import random
import re
import signal
from collections.abc import Iterator
from typing import Any

MAX_REFERENCE_SIZE = 5_000  # IR nodes with counted repeats unrolled, past which the reference is not used

_MUTATION_BYTES = [b"a", b"0", b" ", b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\", b"\n", b"\x00"]
_MUTATION_BYTES += [b"\x7f", b"\xc3", b"\xa9", b"\xe4\xb8\xad", b"\xff", b"\xf0\x9f\x98\x80"]


def mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    """``n`` byte-level mutants of ``data``: a byte replaced, deleted, inserted or a slice doubled."""
    out = []
    for _ in range(n):
        b = bytearray(data)
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            i = min(i, len(b) - 1)
            b[i : i + 1] = rng.choice(_MUTATION_BYTES)
        elif op == 1 and b:
            del b[min(i, len(b) - 1)]
        elif op == 2:
            b[i:i] = rng.choice(_MUTATION_BYTES)
        else:
            j = rng.randrange(i, len(b) + 1)
            b[i:i] = b[i:j] or rng.choice(_MUTATION_BYTES)
        out.append(bytes(b))
    return out


def expanded_size(grammar: Any) -> int:
    """IR nodes with counted repeats unrolled (each rule once), saturating past MAX_REFERENCE_SIZE.
    Iterative: the grammars here may nest deeper than Python's recursion limit."""
    from agent_infer.grammar.ir import Alt, Repeat, Seq

    cap = MAX_REFERENCE_SIZE + 1
    total = 0
    # (expr, copies): a node counts once per unrolled copy of the repeats above it.
    stack = [(expr, 1) for _, expr in grammar.rules]
    while stack and total < cap:
        expr, copies = stack.pop()
        total += copies
        if isinstance(expr, (Seq, Alt)):
            stack.extend((e, copies) for e in expr.items)
        elif isinstance(expr, Repeat):
            count = max(expr.min, expr.max if expr.max is not None else expr.min + 1, 1)
            stack.append((expr.item, min(copies * count, cap)))
    return total


def ecma_validator() -> Any:
    """Draft 2020-12 with ECMA-262 ``pattern`` anchoring, as the compiler implements: ``$`` is the end
    of the string (Python's ``$`` also matches before a final newline). The generated patterns have
    no escaped ``$`` and none inside classes, so a plain replacement is exact for them."""
    import jsonschema

    def pattern(validator: Any, regex: str, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not re.search(regex.replace("$", r"\Z"), instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {regex!r}")

    return jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": pattern})


class OutOfBudget(Exception):
    """A pure-Python helper ran past its time budget (SIGALRM)."""


@contextlib.contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Raise OutOfBudget in this (main) thread once ``seconds`` pass inside the block."""

    def expire(signum: int, frame: Any) -> None:
        raise OutOfBudget

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class DuplicateKey(Exception):
    pass


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise DuplicateKey
    return dict(pairs)


def policy_free(value: Any) -> bool:
    """Whether a valid instance must be accepted: documented false negatives are property order
    (objects) and integral floats spelled ``1.0``."""
    if isinstance(value, dict):
        return False
    if isinstance(value, list):
        return all(policy_free(v) for v in value)
    return not (isinstance(value, float) and value.is_integer())
