"""Logit adjustments before sampling: repetition, presence and frequency penalties, ``logit_bias``
and ``min_tokens`` (vLLM / OpenAI semantics), the DRY penalty (llama.cpp's, see ``dry.py``), the
value-loop closing bias (``value_loops.py``) and the closing pressure near ``max_tokens``
(``budget_close.py``).

A penalty changes which token is chosen, never what the model reports: the sampler applies it to
a copy of the rows that need it, and log-probabilities still come from the unpenalized logits.
Masked logits (``-inf`` from a grammar) stay ``-inf`` under every penalty and bias, so constraints
hold. ``min_tokens`` bans EOS and the stop ids only while some other token remains possible: when a
grammar allows nothing but the end, the end is kept (a row of ``-inf`` has nothing to sample).

Cost is proportional to the sequence length, not the vocabulary: each penalized row gathers and
scatters only the ids that occur in its prompt/output (the closing pressure adds one top-k over the
row in the last stretch of a budget).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.budget_close import budget_close_bias, mask_doomed
from agent_infer.engine.dry import TokenTexts, dry_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.value_loops import ClosingTokens, ValueScanner, value_close_bias


def apply_penalties(
    logits: torch.Tensor,
    seqs: Seq[Sequence],
    eos_token_ids: Collection[int] = (),
    texts: TokenTexts | None = None,
    closing: ClosingTokens | None = None,
) -> torch.Tensor:
    """``logits`` (``[len(seqs), vocab]``) with each sequence's penalties, bias and min_tokens applied.

    ``texts`` decodes single tokens for DRY's sequence breakers; without it a DRY request raises.

    Returns ``logits`` itself when no sequence adjusts its logits, else an adjusted copy.
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
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.bias_pairs if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
                row[ids] += torch.tensor([b for _, b in pairs], dtype=row.dtype)
        if p.dry:
            if texts is None:
                raise ValueError("the DRY penalty needs the tokenizer's token texts")
            amounts = dry_penalties(generated, p, texts)
            amounts = {t: a for t, a in amounts.items() if 0 <= t < vocab}
            if amounts:
                ids = torch.tensor(list(amounts), dtype=torch.long)
                row[ids] -= torch.tensor(list(amounts.values()), dtype=row.dtype)
        if p.value_close:
            _close_value(row, seq, generated, texts, closing)
        if p.budget_close:
            _close_budget(row, seq, len(generated), eos_token_ids)
        if len(generated) < p.min_tokens:
            _ban_end(row, {*eos_token_ids, *p.stop_ids}, vocab)
    return out


def _scanner(seq: Sequence, generated: Seq[int]) -> ValueScanner:
    """The sequence's JSON scanner (a new one if its output is shorter than what was scanned)."""
    scanner = seq.value_scanner
    if scanner is None or scanner.fed > len(generated):
        scanner = seq.value_scanner = ValueScanner()
    return scanner


def _close_value(
    row: torch.Tensor,
    seq: Sequence,
    generated: Seq[int],
    texts: TokenTexts | None,
    closing: ClosingTokens | None,
    scanner: ValueScanner | None = None,
) -> None:
    """The value-loop closing bias (``value_loops.py``) on the closing tokens of the looping value
    and on the first token of the grammar's shortest completion from the matcher's state: a value
    that may not end yet (an e-mail without its ``@``) is led toward the shortest way out.
    ``scanner`` defaults to the sequence's own."""
    if texts is None or closing is None:
        raise ValueError("the value-loop closing bias needs the tokenizer's token texts")
    p = seq.params
    scanner = scanner or _scanner(seq, generated)
    found = value_close_bias(scanner, generated, p.value_close_multiplier, p.value_close_allowed, texts)
    if found is None:
        return
    ids = closing.ids(found[0])
    if ids.numel():
        row[ids] += found[1]
    matcher = seq.matcher
    if matcher is not None and not matcher.is_terminated():
        way_out = matcher.closing_tokens()
        if way_out and 0 <= way_out[0] < row.shape[0] and not bool((ids == way_out[0]).any()):
            row[way_out[0]] += found[1]


def _close_budget(row: torch.Tensor, seq: Sequence, used: int, eos_token_ids: Collection[int]) -> None:
    """The closing pressure near ``max_tokens`` (``budget_close.py``) on the way-out token, and the
    mask on likely tokens that would leave the document unclosable."""
    found = budget_close_bias(seq, used, eos_token_ids)
    if found is not None and 0 <= found[0] < row.shape[0]:
        row[found[0]] += found[1]
    mask_doomed(row, seq, used, eos_token_ids)


def _ban_end(row: torch.Tensor, ends: set[int], vocab: int) -> None:
    ids = torch.tensor(sorted(t for t in ends if 0 <= t < vocab), dtype=torch.long)
    if not ids.numel():
        return
    kept = row[ids].clone()
    row[ids] = float("-inf")
    if not bool(torch.isfinite(row).any()):
        row[ids] = kept


def apply_dry_to_draft_rows(
    rows: torch.Tensor,
    seq: Sequence,
    draft: Seq[int],
    texts: TokenTexts | None,
    closing: ClosingTokens | None = None,
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """``rows`` (``[1 + len(draft), vocab]``, the rows a draft is verified against) with the DRY
    penalty and the value-loop closing bias plain decoding would apply at each: row ``j`` as if
    ``draft[:j]`` had been accepted (the matcher walks the draft for the closing bias and is
    rolled back).

    Returns ``rows`` itself when the request has neither.
    """
    p = seq.params
    if not (p.dry or p.value_close or p.budget_close):
        return rows
    if texts is None:
        raise ValueError("the DRY penalty needs the tokenizer's token texts")
    out = rows.clone()
    vocab = out.shape[1]
    generated = seq.token_ids[seq.num_prompt_tokens :]
    scanner: ValueScanner | None = None
    if p.value_close:
        own = _scanner(seq, generated)
        value_close_bias(own, generated, p.value_close_multiplier, p.value_close_allowed, texts)
        scanner = copy.deepcopy(own)  # walks the draft; the sequence's own stays at its output
    matcher = seq.matcher if p.value_close or p.budget_close else None
    walked = 0
    try:
        for j in range(out.shape[0]):
            prefix = [*generated, *draft[:j]]
            if j and matcher is not None and not matcher.is_terminated():
                if not matcher.accept_token(draft[j - 1]):
                    raise AssertionError(f"grammar rejected draft token {draft[j - 1]} it accepted before")
                walked += 1
            if p.value_close:
                _close_value(out[j], seq, prefix, texts, closing, scanner)
            if p.budget_close:
                _close_budget(out[j], seq, len(prefix), eos_token_ids)
            amounts = dry_penalties(prefix, p, texts)
            amounts = {t: a for t, a in amounts.items() if 0 <= t < vocab}
            if amounts:
                ids = torch.tensor(list(amounts), dtype=torch.long)
                out[j, ids] -= torch.tensor(list(amounts.values()), dtype=out.dtype)
    finally:
        if walked and matcher is not None:
            matcher.rollback(walked)
    return out
