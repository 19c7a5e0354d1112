"""After a step: take each sequence's new tokens through its grammar, stop checks and detokenizer.

Per token, in order: the grammar accepts it (the mask guaranteed it would), budget-aware closing
may replace it (:mod:`agent_infer.engine.closing`), it is appended, and the stop conditions run
(grammar end, stop token, EOS, stop strings, ``max_tokens``, the context length). Once a
sequence's tokens are in, jump-forward appends the tokens its grammar fixes next (fed to the model
as one chunk in the next step) and the speculator proposes the next draft.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agent_infer.engine.closing import closing_after
from agent_infer.engine.output import RequestOutput
from agent_infer.engine.scheduler import Scheduler, SchedulerOutput
from agent_infer.engine.sequence import FinishReason, Sequence
from agent_infer.engine.speculator import Speculator
from agent_infer.engine.step_result import SampledTokens, StepResult
from agent_infer.errors import EngineError

if TYPE_CHECKING:
    from agent_infer.model.tokenizer import Tokenizer


class Postprocessor:
    """Applies a :class:`StepResult` to its sequences and reports their :class:`RequestOutput`.

    ``forced_tokens`` turns jump-forward on; ``speculator`` (None without drafts) proposes each
    sequence's next draft.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        *,
        forced_tokens: bool,
        speculator: Speculator | None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.forced_tokens = forced_tokens
        self.speculator = speculator

    def process(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Account for the step that ran ``plan``; outputs of the sequences that gained a token or
        finished, in batch order."""
        for seq, exc in result.errors.items():
            self.fail(seq, exc)
        self.scheduler.advance(plan)
        outputs: list[RequestOutput] = []
        proposing: list[Sequence] = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.is_finished:  # failed while running
                outputs.append(RequestOutput.from_sequence(seq))
                continue
            sampled = result.sampled.get(seq)
            if sampled is None:
                continue  # a prefill chunk that samples nothing yet
            try:
                if self._accept(seq, sampled):
                    proposing.append(seq)
            except Exception as exc:  # one request's failure must not take the batch down
                self.fail(seq, exc)
            outputs.append(RequestOutput.from_sequence(seq))
        if self.speculator is not None and proposing:
            self._propose(proposing)
        return outputs

    def _propose(self, seqs: list[Sequence]) -> None:
        """The next drafts of ``seqs``, in one batch (MTP drafts run the module once for all)."""
        try:
            assert self.speculator is not None
            self.speculator.propose_all(seqs)
        except Exception:
            # A batched proposal cannot tell whose request failed: retry alone to pin it down.
            for seq in seqs:
                try:
                    self.speculator.propose_all([seq])  # type: ignore[union-attr]
                except Exception as exc:
                    self.fail(seq, exc)

    def jump_at_start(self, seq: Sequence) -> None:
        """Append the tokens the grammar fixes before any sampling (e.g. ``{"name":``), so they are
        prefilled with the prompt instead of costing a step of their own (``seq`` may finish)."""
        if not self.forced_tokens or seq.matcher is None or seq.logprobs is not None:
            return
        try:
            self._jump_forward(seq)
            if self.speculator is not None and not seq.is_finished:
                self.speculator.propose(seq)  # e.g. the boundary of the leading forced text
        except Exception as exc:  # one request's failure must not take the batch down
            self.fail(seq, exc)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """End ``seq`` with ``finish_reason="error"`` and the exception as its error."""
        seq.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        self.scheduler.finish(seq)

    def _accept(self, seq: Sequence, sampled: SampledTokens) -> bool:
        """Take this step's tokens and jump forward; True when ``seq`` goes on (its next draft is
        proposed with the batch's)."""
        seq.spec.draft = []
        logprobs = sampled.logprobs
        for i, token in enumerate(sampled.token_ids):
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                # The mask allows only tokens the matcher accepts; reaching this is an engine bug.
                raise EngineError(f"grammar rejected sampled token {token} despite the mask")
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = time.perf_counter()
            if seq.params.close_on_length and self._close(seq, token):
                return False
            if seq.logprobs is not None and logprobs is not None:
                seq.logprobs.append(logprobs)
            finished = self._append(seq, token)
            if i < sampled.num_accepted_draft:
                seq.num_computed_tokens += 1  # the step already wrote this draft token's KV
            if finished:
                return False
        # Forced tokens have no model distribution to report, so requests asking for logprobs
        # sample every token instead of jumping forward.
        if self.forced_tokens and seq.matcher is not None and seq.logprobs is None:
            self._jump_forward(seq)
        if not seq.is_finished and seq.num_computed_tokens >= seq.num_tokens:
            # A whole draft was taken without a sampled token only because forced tokens follow it.
            raise EngineError("no token left to feed after a draft (forced tokens expected)")
        return not seq.is_finished

    def _jump_forward(self, seq: Sequence) -> None:
        """Append the tokens the grammar fixes next; the scheduler feeds them as one chunk."""
        assert seq.matcher is not None
        for token in seq.matcher.forced_tokens():
            if not seq.matcher.accept_token(token):
                raise EngineError(f"grammar rejected its own forced token {token}")
            if seq.params.close_on_length and self._close(seq, token):
                return
            seq.num_forced_tokens += 1
            if self._append(seq, token):
                return

    def _close(self, seq: Sequence, token: int) -> bool:
        """Budget-aware closing (closing.py): True when ``token`` was replaced and ``seq`` finished."""
        closing = closing_after(seq, token, self.max_model_len)
        if closing is None:
            return False
        assert seq.matcher is not None
        for t in closing:
            if not seq.matcher.accept_token(t):
                raise EngineError(f"grammar rejected its own closing token {t}")
            seq.num_closing_tokens += 1
            if self._append(seq, t):
                return True
        raise EngineError("closing tokens did not finish the request")

    def accept_first_token(self, seq: Sequence, token: int) -> bool:
        """Record a first token sampled elsewhere (a prefill worker's) with the stop checks of a
        sampled one; True when it finished ``seq``. Requests with a grammar never come here."""
        return self._append(seq, token)

    def _append(self, seq: Sequence, token: int) -> bool:
        """Record one accepted token and apply the stop conditions; True when ``seq`` finished."""
        seq.append_token(token)
        params = seq.params
        grammar_done = seq.matcher is not None and seq.matcher.is_terminated()
        if (
            grammar_done
            or token in params.stop_ids
            or (token in self.eos_token_ids and not params.ignore_eos)
        ):
            # The stop token stays in token_ids but its text is not part of the answer.
            self._finish(seq, FinishReason.STOP)
            return True
        self._detokenize(seq)
        if params.stop_strings and seq.num_output_tokens < params.min_tokens:
            seq.stop_checked_len = len(seq.output_text)  # text before min_tokens never stops it
        if params.stop_strings and seq.num_output_tokens >= params.min_tokens and self._truncate_at_stop(seq):
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)
        return seq.is_finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish(reason)
        self.scheduler.finish(seq)

    def _detokenize(self, seq: Sequence) -> None:
        """Append the text of newly completed characters to ``seq.output_text``."""
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        before = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip)
        after = self.tokenizer.decode(ids[seq.prefix_offset :], skip)
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more tokens.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.output_text += after[len(before) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        """Cut ``seq.output_text`` at the earliest stop string; True when one was found."""
        stops = seq.params.stop_strings
        text = seq.output_text
        # A new match must end in the new text, so it starts at most len(stop)-1 chars before it;
        # this also catches stop strings spanning several tokens.
        start = max(0, seq.stop_checked_len - max(len(s) for s in stops) + 1)
        found = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
        seq.stop_checked_len = len(text)
        if not found:
            return False
        at, length = min(found)
        seq.output_text = text[: at + length] if seq.params.include_stop_str_in_output else text[:at]
        return True
