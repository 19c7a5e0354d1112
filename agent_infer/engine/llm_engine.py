"""The engine loop: ``schedule → run → postprocess``, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from agent_infer import envs
from agent_infer.accelerator import get_accelerator
from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.closing import closing_after
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.engine.output import RequestOutput
from agent_infer.engine.penalties import apply_dry_to_draft_rows
from agent_infer.engine.sampler import Sampler, SamplerOutput, make_generator
from agent_infer.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from agent_infer.engine.sequence import FinishReason, Sequence
from agent_infer.engine.speculator import Speculator, can_draft
from agent_infer.errors import EngineError, InvalidRequestError, PromptTooLongError
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.sampling_params import SamplingParams

#: A prompt is text, token ids, or a chat conversation (``[{"role": ..., "content": ...}, ...]``).
Prompt = str | list[int] | list[dict[str, Any]]

# Tokens decoded before the new ones so that tokenizers which drop a word's leading space when it
# starts a decode (SentencePiece) still produce the right text.
_DETOKENIZE_CONTEXT = 5

# How long step() blocks for a grammar compile when nothing else can run; short, so that aborts
# and new requests are still served promptly.
_GRAMMAR_POLL_SECONDS = 0.05


class LLMEngine:
    """Accepts requests, steps the batch, and reports progress as :class:`RequestOutput`.

    ``model`` is a path accepted by :func:`agent_infer.model.loader.load_model` (None for the
    default model); pass ``loaded`` to share already-loaded weights.
    """

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        threads = envs.num_threads()
        if threads:
            torch.set_num_threads(threads)
        self.accelerator = get_accelerator(self.config.accelerator)
        if loaded is None:
            loaded = load_model(model, device=self.accelerator.device, dtype=self.config.torch_dtype)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model_len = loaded.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        self.runner = ModelRunner(loaded, self.config, self.accelerator)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.scheduler.on_grammar_ready = self._jump_at_start
        self.sampler = Sampler(self.eos_token_ids, self.tokenizer.decode)
        self.grammar = GrammarManager(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            num_workers=self.config.grammar_workers,
            overlap=self.config.use_async_scheduling,
        )
        boundary = self.config.forced_tokens and self.config.boundary_drafts
        self.speculator = (
            Speculator(
                self.config.speculative_tokens, self.max_model_len, self.config.forced_tokens, boundary
            )
            if self.config.speculative_tokens or boundary
            else None
        )
        self.requests: dict[str, Sequence] = {}
        # Outputs of requests ended outside a step (abort), delivered by the next step().
        self._pending: list[RequestOutput] = []

    # --- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a request. Bad input raises :class:`InvalidRequestError` (or a subclass) at once."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", field="params")
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; with at least one generated token it exceeds the "
                f"context of {self.max_model_len} tokens",
                field="prompt",
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(token_ids) + 1 > capacity:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens but the KV cache holds only {capacity}",
                field="prompt",
            )
        seq = Sequence(
            request_id,
            token_ids,
            params,
            prompt=text,
            generator=None if params.greedy else make_generator(params, self.accelerator.device),
        )
        if params.structured is not None:
            # Lowered here so a bad constraint fails this request alone, at once; the token-level
            # compile runs in the worker pool while the request waits in WAITING_FOR_GRAMMAR.
            seq.grammar_future = self.grammar.submit(self.grammar.lower(params.structured))
        seq.prefix_offset = max(len(token_ids) - _DETOKENIZE_CONTEXT, 0)
        seq.read_offset = len(token_ids)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _tokenize(self, prompt: object) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", field="prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, SequenceABC) or not prompt:
            raise InvalidRequestError(
                "prompt must be a non-empty string, list of token ids, or list of chat messages",
                field="prompt",
            )
        if all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        ids = list(prompt)
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token {token!r} is not an id in [0, {self.vocab_size})", field="prompt"
                )
        return None, ids

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes from the next step()."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        seq.finish(FinishReason.ABORT)
        self.scheduler.finish(seq)
        self._pending.append(self._release(seq))

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an undelivered final output."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of requests that produced a token or finished."""
        outputs, self._pending = self._pending, []
        self.scheduler.wait_for_grammars(_GRAMMAR_POLL_SECONDS)
        plan = self.scheduler.schedule()
        for seq in plan.failed:
            outputs.append(self._release(seq))
        if not plan.scheduled:
            return outputs
        sampled = self._execute(plan)
        self.scheduler.advance(plan)
        for item in plan.scheduled:
            seq = item.seq
            if seq.is_finished:  # failed inside _execute
                outputs.append(self._release(seq))
                continue
            if seq in sampled:
                tokens, logprobs, num_drafted = sampled[seq]
                try:
                    self._postprocess(seq, tokens, logprobs, num_drafted)
                except Exception as exc:  # one request's failure must not take the batch down
                    self._fail(seq, exc)
                outputs.append(self._release(seq) if seq.is_finished else RequestOutput.from_sequence(seq))
        return outputs

    def _execute(
        self, plan: SchedulerOutput
    ) -> dict[Sequence, tuple[list[int], dict[int, float] | None, int]]:
        """Forward and sample the batch; if the batch raises, retry items alone to isolate the culprit."""
        try:
            return self._forward_and_sample(plan.scheduled)
        except Exception as exc:
            if len(plan.scheduled) == 1:
                self._fail(plan.scheduled[0].seq, exc)
                return {}
        # Re-running an item rewrites the same KV slots with the same values, so retrying is safe.
        sampled: dict[Sequence, tuple[list[int], dict[int, float] | None, int]] = {}
        for item in plan.scheduled:
            try:
                sampled.update(self._forward_and_sample([item]))
            except Exception as exc:
                self._fail(item.seq, exc)
        return sampled

    def _forward_and_sample(
        self, batch: list[ScheduledSequence]
    ) -> dict[Sequence, tuple[list[int], dict[int, float] | None, int]]:
        """Run the model on ``batch``; per sampling sequence, the tokens it gains this step (one,
        or with a draft the accepted draft tokens plus one) and the logprobs entry."""
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
            result: SamplerOutput = self.sampler(logits, seqs)
            return {seq: ([tok], lp, 0) for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)}
        return self._verify(logits, seqs, drafts)

    def _verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]]
    ) -> dict[Sequence, tuple[list[int], dict[int, float] | None, int]]:
        """Sample the rows of sequences without a draft; verify the drafts of the others."""
        assert self.speculator is not None
        starts: list[int] = []
        row = 0
        for draft in drafts:
            starts.append(row)
            row += 1 + len(draft)
        out: dict[Sequence, tuple[list[int], dict[int, float] | None, int]] = {}
        plain = [i for i, draft in enumerate(drafts) if not draft]
        if plain:
            index = torch.tensor([starts[i] for i in plain], dtype=torch.int64, device=logits.device)
            result = self.sampler(logits.index_select(0, index), [seqs[i] for i in plain])
            for i, tok, lp in zip(plain, result.token_ids, result.logprobs):
                out[seqs[i]] = ([tok], lp, 0)
        for i, draft in enumerate(drafts):
            if draft:
                rows = logits[starts[i] : starts[i] + 1 + len(draft)]
                rows = apply_dry_to_draft_rows(rows, seqs[i], draft, self.sampler.texts)
                tokens, num_drafted = self.speculator.verify(seqs[i], draft, rows)
                out[seqs[i]] = (tokens, None, num_drafted)
        return out

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        seq.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        self.scheduler.finish(seq)

    def _release(self, seq: Sequence) -> RequestOutput:
        """Final output of a finished sequence; the engine forgets the request."""
        self.requests.pop(seq.request_id, None)
        return RequestOutput.from_sequence(seq)

    # --- postprocess -------------------------------------------------------------------------------

    def _postprocess(
        self, seq: Sequence, tokens: list[int], logprobs: dict[int, float] | None, num_drafted: int = 0
    ) -> None:
        """Take this step's tokens (``num_drafted`` accepted draft tokens, whose KV this step wrote,
        then usually one sampled token), jump forward, and propose the next draft."""
        seq.draft_ids = []
        for i, token in enumerate(tokens):
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                # The mask allows only tokens the matcher accepts; reaching this is an engine bug.
                raise EngineError(f"grammar rejected sampled token {token} despite the mask")
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = time.perf_counter()
            if seq.params.close_on_length and self._close(seq, token):
                return
            if seq.logprobs is not None and logprobs is not None:
                seq.logprobs.append(logprobs)
            finished = self._append(seq, token)
            if i < num_drafted:
                seq.num_computed_tokens += 1
            if finished:
                return
        # Forced tokens have no model distribution to report, so requests asking for logprobs
        # sample every token instead of jumping forward.
        if self.config.forced_tokens and seq.matcher is not None and seq.logprobs is None:
            self._jump_forward(seq)
        if not seq.is_finished and seq.num_computed_tokens >= seq.num_tokens:
            # A whole draft was taken without a sampled token only because forced tokens follow it.
            raise EngineError("no token left to feed after a draft (forced tokens expected)")
        if self.speculator is not None and not seq.is_finished and can_draft(seq.params):
            self.speculator.propose(seq)

    def _jump_at_start(self, seq: Sequence) -> bool:
        """Append the tokens the grammar fixes before any sampling (e.g. ``{"name":``), so they are
        prefilled with the prompt instead of costing a step of their own; True when ``seq`` ended."""
        if not self.config.forced_tokens or seq.logprobs is not None:
            return False
        try:
            self._jump_forward(seq)
            if self.speculator is not None and not seq.is_finished and can_draft(seq.params):
                self.speculator.propose(seq)  # e.g. the boundary of the leading forced text
        except Exception as exc:  # one request's failure must not take the batch down
            self._fail(seq, exc)
        return seq.is_finished

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
        before = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
        after = self.tokenizer.decode(ids[seq.prefix_offset :])
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
        found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        seq.stop_checked_len = len(text)
        if not found:
            return False
        seq.output_text = text[: min(found)]
        return True
