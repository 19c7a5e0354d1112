"""Token selection from logits: penalties, then greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness is batch-invariant: every sampled row is processed on its own and draws exactly one
uniform number from its request's ``torch.Generator`` (inverse-CDF sampling), so a seeded request
produces the same tokens whether it runs alone or next to any number of other requests.

Cost matters as much as correctness here: a full sort of a 49k vocabulary takes ~10 ms per row on
CPU, so top-k/top-p work on a ``topk`` candidate set that grows only when the nucleus needs it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from agent_infer.engine.dry import TokenTexts
from agent_infer.engine.penalties import apply_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.value_loops import ClosingTokens
from agent_infer.model.layers.native_ops import argmax_rows
from agent_infer.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A generator seeded from ``params.seed``, or from a fresh random seed when it is None."""
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplerOutput:
    """Per row: the chosen token, and (when requested) ``{token_id: logprob}`` for it and the top-n."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


# First candidate-set size for top-p without top-k; quadrupled until it covers the nucleus.
_TOP_P_CANDIDATES = 128


class Sampler:
    """Chooses one token per logits row according to each sequence's :class:`SamplingParams`."""

    def __init__(
        self, eos_token_ids: Collection[int] = (), decode: Callable[[list[int]], str] | None = None
    ) -> None:
        # Banned by ``min_tokens`` until a request has generated enough tokens.
        self.eos_token_ids = tuple(eos_token_ids)
        # ``decode`` (the tokenizer's) gives DRY the token texts its sequence breakers are found in.
        self.texts = TokenTexts(decode) if decode is not None else None
        self._closing: ClosingTokens | None = None

    def closing(self, vocab_size: int) -> ClosingTokens | None:
        """The value-closing tokens of this vocabulary (None without a ``decode``)."""
        if self._closing is None and self.texts is not None:
            self._closing = ClosingTokens(vocab_size, self.texts)
        return self._closing

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample from ``logits`` (float32 ``[len(seqs), vocab]``); row ``i`` belongs to ``seqs[i]``."""
        params = [seq.params for seq in seqs]
        scores = apply_penalties(logits, seqs, self.eos_token_ids, self.texts, self.closing(logits.shape[1]))
        # Greedy rows need one batched kernel and one device-to-host copy. The scan is ~0.3 ms for
        # 16 rows of a 129k vocabulary on one Zen 4 core; taking it inside the packed head kernel
        # (each output stripe while still in L2) was no faster there: the head streams its weights
        # from memory and the fused scan adds its time to that stream instead of hiding in it.
        token_ids: list[int] = argmax_rows(scores)
        for i, p in enumerate(params):
            if not p.greedy:
                token_ids[i] = sample_row(scores[i], p, seqs[i].generator)

        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if any(p.logprobs is not None for p in params):
            # Reported log-probabilities are the model's own distribution, before any filtering.
            log_probs = torch.log_softmax(logits, dim=-1)
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                entry = {token_ids[i]: float(log_probs[i, token_ids[i]])}
                if p.logprobs > 0:
                    top = torch.topk(log_probs[i], p.logprobs)
                    for value, token in zip(top.values.tolist(), top.indices.tolist()):
                        entry.setdefault(token, value)
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from a single ``[vocab]`` logits row under ``params`` (temperature > 0).

    Order of filters: temperature, top-k (renormalised), top-p on what is left, then min-p relative
    to the most likely survivor. Consumes exactly one number from ``generator``.
    """
    scaled = logits / params.temperature
    vocab = scaled.shape[0]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    indices: torch.Tensor | None = None
    if top_k or params.top_p < 1.0:
        log_z = torch.logsumexp(scaled, dim=0)
        k = top_k or min(_TOP_P_CANDIDATES, vocab)
        while True:
            values, indices = torch.topk(scaled, k)
            probs = torch.exp(values - log_z)
            # Without top-k the candidates must hold the whole nucleus, else the cut would be wrong.
            if top_k or k == vocab or float(probs.sum()) >= params.top_p:
                break
            k = min(k * 4, vocab)
        if top_k:
            probs = probs / probs.sum()
        if params.top_p < 1.0:
            # A token stays if the mass strictly before it is below top_p: the top token always stays.
            mass_before = torch.cumsum(probs, dim=0) - probs
            probs = probs.masked_fill(mass_before >= params.top_p, 0.0)
    else:
        probs = torch.softmax(scaled, dim=0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < probs.max() * params.min_p, 0.0)
    cdf = torch.cumsum(probs, dim=0)
    u = torch.rand((1,), generator=generator, device=cdf.device, dtype=cdf.dtype)
    # right=True lands on the first token whose cumulative mass exceeds u, never a zeroed one.
    pos = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=cdf.shape[0] - 1)
    chosen = indices[pos] if indices is not None else pos
    return int(chosen.item())
