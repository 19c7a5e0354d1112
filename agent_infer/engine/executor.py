"""Runs one scheduled batch: the forward pass with the grammar masks, then sampling or draft verification."""

from __future__ import annotations

import time

import torch

from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.engine.penalties import apply_dry_to_draft_rows
from agent_infer.engine.sampler import Sampler
from agent_infer.engine.scheduler import ScheduledSequence
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.speculator import Speculator
from agent_infer.engine.step_result import SampledTokens, StepResult


class Executor:
    """Turns a batch into the tokens each sampling sequence gains (:class:`StepResult`).

    The bitmask fill of constrained rows runs alongside the forward pass (on a background thread
    with async scheduling); rows of sequences with a draft are verified by the speculator, the
    others sampled.
    """

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        grammar: GrammarManager,
        speculator: Speculator | None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.grammar = grammar
        self.speculator = speculator

    def run(self, batch: list[ScheduledSequence]) -> StepResult:
        """Forward and sample ``batch``; if the batch raises, retry items alone to isolate the culprit."""
        try:
            return StepResult(self._forward_and_sample(batch), {})
        except Exception as exc:
            if len(batch) == 1:
                return StepResult({}, {batch[0].seq: exc})
        # Re-running an item rewrites the same KV slots with the same values, so retrying is safe.
        sampled: dict[Sequence, SampledTokens] = {}
        errors: dict[Sequence, BaseException] = {}
        for item in batch:
            try:
                sampled.update(self._forward_and_sample([item]))
            except Exception as exc:
                errors[item.seq] = exc
        return StepResult(sampled, errors)

    def _forward_and_sample(self, batch: list[ScheduledSequence]) -> dict[Sequence, SampledTokens]:
        """Run the model on ``batch``; per sampling sequence, the tokens it gains this step."""
        started = time.perf_counter()
        out = self._forward_and_choose(batch)
        if self.speculator is not None:
            # What a step costs is what an accepted draft token saves: the speculator weighs drafts by it.
            self.speculator.observe_step(batch, time.perf_counter() - started)
        if self.runner.hidden:
            # Hidden rows of the positions the step committed (the chunk and the accepted draft
            # prefix) go to the MTP module once their next tokens are known.
            for item in batch:
                kept = self.runner.hidden.get(item.seq)
                if kept is None:
                    continue
                sampled = out.get(item.seq)
                committed = item.num_new_tokens + (sampled.num_accepted_draft if sampled is not None else 0)
                item.seq.spec.add_mtp_rows(kept[0], kept[1][:committed])
        return out

    def _forward_and_choose(self, batch: list[ScheduledSequence]) -> dict[Sequence, SampledTokens]:
        items = [item for item in batch if item.samples]
        seqs = [item.seq for item in items]
        drafts = [item.draft for item in items]
        # With async scheduling the fill runs on a background thread during the forward pass; the
        # matchers already hold every token accepted so far, forced ones included.
        pending = self.grammar.start_masks(seqs, drafts if any(drafts) else None)
        try:
            logits = self.runner.run(batch, pending.result if pending is not None else None)
        except BaseException:
            if pending is not None:
                pending.wait_quietly()  # the retry path must not fill these matchers concurrently
            raise
        if logits is None:
            return {}
        self.grammar.apply_masks(logits, pending)
        if not any(drafts):
            result = self.sampler(logits, seqs)
            return {
                seq: SampledTokens([tok], lp) for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)
            }
        return self._verify(logits, seqs, drafts)

    def _verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]]
    ) -> dict[Sequence, SampledTokens]:
        """Sample the rows of sequences without a draft; verify the drafts of the others."""
        assert self.speculator is not None
        starts: list[int] = []
        row = 0
        for draft in drafts:
            starts.append(row)
            row += 1 + len(draft)
        out: dict[Sequence, SampledTokens] = {}
        plain = [i for i, draft in enumerate(drafts) if not draft]
        if plain:
            index = torch.tensor([starts[i] for i in plain], dtype=torch.int64, device=logits.device)
            result = self.sampler(logits.index_select(0, index), [seqs[i] for i in plain])
            for i, tok, lp in zip(plain, result.token_ids, result.logprobs):
                out[seqs[i]] = SampledTokens([tok], lp)
        for i, draft in enumerate(drafts):
            if draft:
                rows = logits[starts[i] : starts[i] + 1 + len(draft)]
                rows = apply_dry_to_draft_rows(
                    rows,
                    seqs[i],
                    draft,
                    self.sampler.texts,
                    self.sampler.closing(rows.shape[1]),
                    self.sampler.eos_token_ids,
                )
                tokens, num_accepted = self.speculator.verify(seqs[i], draft, rows)
                out[seqs[i]] = SampledTokens(tokens, None, num_accepted)
        return out
