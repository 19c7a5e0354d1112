"""Token selection from logits: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness is batch-invariant: each row draws its own exponential noise from its request's
``torch.Generator`` and picks ``argmax(p / noise)`` (the exponential race, equivalent to sampling
from ``p``). A seeded request therefore produces the same tokens whether it runs alone or next to
any number of other requests.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from agent_infer.engine.sequence import Sequence
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


class Sampler:
    """Chooses one token per logits row according to each sequence's :class:`SamplingParams`."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample from ``logits`` (float32 ``[len(seqs), vocab]``); row ``i`` belongs to ``seqs[i]``."""
        params = [seq.params for seq in seqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        if all(p.greedy for p in params) and not want_logprobs:
            # Fast path for the common greedy batch: one kernel, one device-to-host copy.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(seqs))

        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = [params[i] for i in random_rows]
            probs = _filtered_probs(logits.index_select(0, rows), sub)
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                generator = seqs[i].generator
                noise[j].exponential_(generator=generator)
            chosen.index_copy_(0, rows, (probs / noise).argmax(dim=-1))
        token_ids = chosen.tolist()

        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if want_logprobs:
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


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled probabilities with top-k, top-p and min-p applied row by row."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    scaled = logits / temps.unsqueeze(1)
    vocab = scaled.shape[-1]

    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks):
        k_max = max(k for k in top_ks if k < vocab)
        top_values = torch.topk(scaled, k_max, dim=-1).values
        ks = torch.tensor([min(k, k_max) - 1 for k in top_ks], device=device)
        kth = top_values.gather(1, ks.unsqueeze(1))
        # Rows without top-k keep everything.
        no_k = torch.tensor([k >= vocab for k in top_ks], device=device)
        kth = kth.masked_fill(no_k.unsqueeze(1), float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)

    if any(p.top_p < 1.0 for p in params):
        top_ps = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # A token stays if the mass strictly before it is below top_p, so the top token always stays.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)

    if any(p.min_p > 0.0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
