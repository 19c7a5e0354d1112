"""Repetition, presence and frequency penalties on next-token logits (vLLM / OpenAI semantics).

A penalty changes which token is chosen, never what the model reports: the sampler applies it to
a copy of the rows that need it, and log-probabilities still come from the unpenalized logits.
Masked logits (``-inf`` from a grammar) stay ``-inf`` under every penalty, so constraints hold.

Cost is proportional to the sequence length, not the vocabulary: each penalized row gathers and
scatters only the ids that occur in its prompt/output.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """``logits`` (``[len(seqs), vocab]``) with each sequence's penalties applied.

    Returns ``logits`` itself when no sequence has a penalty, else a penalized copy.
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
    if not rows:
        return logits
    out = logits.clone()
    vocab = out.shape[1]
    for i in rows:
        seq = seqs[i]
        p = seq.params
        row = out[i]
        generated = seq.token_ids[seq.num_prompt_tokens :]
        if p.repetition_penalty != 1.0 and seq.token_ids:
            seen = torch.tensor(sorted({t for t in seq.token_ids if 0 <= t < vocab}), dtype=torch.long)
            if seen.numel():
                values = row[seen]
                row[seen] = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty
                )
        if (p.presence_penalty or p.frequency_penalty) and generated:
            ids, counts = torch.unique(
                torch.tensor([t for t in generated if 0 <= t < vocab], dtype=torch.long),
                return_counts=True,
            )
            if ids.numel():
                row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return out
