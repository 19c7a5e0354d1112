"""What every draft source hands the speculator: a :class:`Draft`, and the names of the sources.

A draft is the tokens a source guesses for a request's next positions, with the source's own
probability of each (1.0 for grammar-forced text, the MTP head's softmax for MTP drafts, and the
request's recent per-token acceptance for prompt lookup, which has no distribution of its own).
:func:`expected_accepted` turns those into the number of tokens verification is expected to keep,
which is how a request picks, per step, the source that pays most.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Source names, as reported in metrics and accepted by ``speculative_source``.
FORCED = "forced"
NGRAM = "ngram"
MTP = "mtp"
SOURCES = (FORCED, NGRAM, MTP)

#: Values of ``speculative_source`` (engine option, environment, per request).
AUTO = "auto"
OFF = "off"
SOURCE_MODES = (AUTO, MTP, NGRAM, OFF)


@dataclass(slots=True)
class Draft:
    """Tokens one source proposes for a request, with its probability of each."""

    source: str
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


def expected_accepted(probs: list[float]) -> float:
    """Tokens verification keeps on average when token ``i`` survives with ``probs[i]`` given the
    ones before it: ``sum_i prod_{j <= i} probs[j]``."""
    total, run = 0.0, 1.0
    for p in probs:
        run *= p
        total += run
    return total
