"""The engine loop: ``schedule → run → postprocess``, one step at a time."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from agent_infer import envs
from agent_infer.accelerator import get_accelerator
from agent_infer.engine.block_manager import BlockManager, window_of_every_layer
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.drafts.mtp import MTPDrafter
from agent_infer.engine.drafts.vocab import build_draft_vocab
from agent_infer.engine.executor import Executor
from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.engine.kv_tier import HostKVTier
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.engine.output import RequestOutput
from agent_infer.engine.postprocessor import Postprocessor
from agent_infer.engine.sampler import Sampler, make_generator
from agent_infer.engine.scheduler import ScheduledSequence, Scheduler
from agent_infer.engine.sequence import FinishReason, Sequence, SequenceStatus
from agent_infer.engine.speculator import Speculator
from agent_infer.errors import ConfigError, EngineError, InvalidRequestError, PromptTooLongError
from agent_infer.model.families.deepseek_mtp import MTPStack
from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
from agent_infer.model.families.deepseek_v4 import DeepseekV4ForCausalLM
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.sampling_params import SamplingParams
from agent_infer.tool_formats import detect_format

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
        self.speculative_source, mtp_stack = self._speculative_source(loaded)
        extra = MTPDrafter.bytes_per_token(mtp_stack, self.config.torch_dtype) if mtp_stack is not None else 0
        self.runner = ModelRunner(loaded, self.config, self.accelerator, extra_bytes_per_token=extra)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            sliding_window=window_of_every_layer(loaded.config.sliding_window, loaded.config.layer_types),
        )
        if self.config.host_kv_cache_bytes:
            self.block_manager.tier = HostKVTier(self.runner.kv_cache, self.config.host_kv_cache_bytes)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.sampler = Sampler(self.eos_token_ids, self.tokenizer.decode)
        self.grammar = GrammarManager(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            num_workers=self.config.grammar_workers,
            overlap=self.config.use_async_scheduling,
            # The chat template's tool-call markers: a real model writes each as one token.
            text_special_tokens=detect_format(self.tokenizer.chat_template).delimiters,
        )
        boundary = self.config.forced_tokens and self.config.boundary_drafts
        guessed = self.config.speculative_tokens if self.speculative_source != "off" else 0
        mtp = None
        if mtp_stack is not None:
            vocab = build_draft_vocab(
                self.config.speculative_draft_vocab_resolved,
                self.vocab_size,
                loaded.path,
                self.tokenizer,
                self.eos_token_ids,
            )
            mtp = MTPDrafter(
                mtp_stack,
                self.runner.num_blocks * self.config.block_size,
                self.config.block_size,
                self.config.max_num_seqs,
                self.config.speculative_confidence,
                vocab,
                self.accelerator.device,
                self.config.torch_dtype,
            )
            self.runner.keep_hidden = lambda seq: seq.spec.use_mtp
        self.speculator = (
            Speculator(
                guessed,
                self.max_model_len,
                self.config.forced_tokens,
                boundary,
                mtp=mtp,
                mode=self.speculative_source,
                row_multiple=loaded.model.kernels.row_multiple,
            )
            if guessed or boundary
            else None
        )
        self.executor = Executor(self.runner, self.sampler, self.grammar, self.speculator)
        self.postprocessor = Postprocessor(
            self.scheduler,
            self.tokenizer,
            self.eos_token_ids,
            self.max_model_len,
            forced_tokens=self.config.forced_tokens,
            speculator=self.speculator,
        )
        self.requests: dict[str, Sequence] = {}
        #: Called with each step's batch (possibly empty) before it runs: expert-parallel ranks
        #: step in lock-step through it (agent_infer/parallel/lockstep.py).
        self.step_hook: Callable[[list[ScheduledSequence]], None] | None = None
        #: Called before each step chooses its batch: data-parallel ranks take long waiting prompts
        #: out of the queue there, to prefill them context-parallel (agent_infer/parallel/cp_engine.py).
        self.before_schedule: Callable[[], None] | None = None
        # Outputs of requests ended outside a step (abort), delivered by the next step().
        self._pending: list[RequestOutput] = []

    def _speculative_source(self, loaded: LoadedModel) -> tuple[str, MTPStack | None]:
        """The engine's ``speculative_source`` and the MTP modules to draft with (None: no MTP
        drafts). ``"mtp"`` on a model without MTP layers raises :class:`ConfigError`."""
        source = self.config.speculative_source_resolved
        model = loaded.model
        stack: MTPStack | None = None
        skipped: str | None = None
        if isinstance(model, DeepseekV3ForCausalLM):
            stack = model.mtp_stack()
        elif isinstance(model, DeepseekV4ForCausalLM):
            stack, skipped = model.mtp_stack(), model.mtp_skipped
        has_mtp = stack is not None
        if source == "mtp" and not has_mtp:
            why = f"its MTP layers were not loaded: {skipped}" if skipped else "none"
            raise ConfigError(
                f"speculative_source='mtp' needs a checkpoint with MTP layers; {loaded.path} has {why} "
                "(use 'auto' or 'ngram')"
            )
        use = has_mtp and source in ("auto", "mtp") and self.config.speculative_tokens > 0
        return source, stack if use else None

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
        if self.speculator is not None:
            self.speculator.configure(seq)
        elif params.speculative_source == "mtp":
            raise InvalidRequestError(
                "speculative_source='mtp' needs MTP drafts, and this engine runs without drafts",
                field="speculative_source",
            )
        if params.structured is not None:
            # Lowered here so a bad constraint fails this request alone, at once; the token-level
            # compile runs in the worker pool while the request waits in WAITING_FOR_GRAMMAR.
            grammar = self.grammar.lower(params.structured)
            seq.constraint_warnings = grammar.warnings
            seq.grammar_future = self.grammar.submit(grammar)
        seq.prefix_offset = max(len(token_ids) - _DETOKENIZE_CONTEXT, 0)
        seq.read_offset = len(token_ids)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def add_prefilled_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        first_token: int,
        load_kv: Callable[[list[int], int], int],
    ) -> None:
        """Queue a request whose prompt KV and first token another replica computed.

        Blocks for the prompt are allocated at once (those this pool's prefix cache holds are
        reused); ``load_kv(block_table, first_block)`` fills the others with the prompt's KV. The
        request then decodes from ``first_token`` without running its prompt. Raises
        :class:`InvalidRequestError` for a constrained request (its grammar would have to replay the
        first token) and :class:`EngineError` when the pool cannot hold the prompt now.
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        if params.structured is not None:
            raise InvalidRequestError(
                "constrained requests cannot be decoded from another replica's prefill", field="structured"
            )
        if not 0 <= first_token < self.vocab_size:
            raise InvalidRequestError(
                f"first token {first_token} is not in the vocabulary", field="first_token"
            )
        if len(token_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; it exceeds the context of {self.max_model_len}",
                field="prompt",
            )
        seq = Sequence(
            request_id,
            list(token_ids),
            params,
            generator=None if params.greedy else make_generator(params, self.accelerator.device),
        )
        seq.prefix_offset = max(len(token_ids) - _DETOKENIZE_CONTEXT, 0)
        seq.read_offset = len(token_ids)
        if not self.block_manager.can_allocate(seq):
            raise EngineError(
                f"the KV pool cannot hold the {len(token_ids)}-token prompt of {request_id!r} now"
            )
        self.block_manager.allocate(seq)
        cached = seq.num_computed_tokens
        try:
            load_kv(seq.block_table, cached // self.block_manager.block_size)
        except BaseException:
            self.block_manager.deallocate(seq)
            raise
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = cached
        self.block_manager.register_computed(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        self.requests[request_id] = seq
        if self.postprocessor.accept_first_token(seq, first_token):
            self.requests.pop(request_id, None)
            self._pending.append(RequestOutput.from_sequence(seq))

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
        self.requests.pop(request_id, None)
        self._pending.append(RequestOutput.from_sequence(seq))

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an undelivered final output."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of requests that produced a token or finished.

        Requests whose grammar compiled join the queue, the scheduler picks the batch (chunks and
        drafts), the executor runs it (forward pass, masks, sampling or draft verification), and
        the postprocessor takes each sequence's new tokens through grammar, stop checks and text.
        """
        delivered, self._pending = self._pending, []
        outputs = self._admit_compiled()
        if self.before_schedule is not None:
            self.before_schedule()
        plan = self.scheduler.schedule()
        outputs += [RequestOutput.from_sequence(seq) for seq in plan.failed]
        if self.step_hook is not None:
            self.step_hook(plan.scheduled)
        if plan.scheduled:
            result = self.executor.run(plan.scheduled)
            outputs += self.postprocessor.process(plan, result)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return delivered + outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled, after the tokens their grammar fixes at the
        start (prefilled with the prompt); outputs of those that ended instead."""
        self.scheduler.wait_for_grammars(_GRAMMAR_POLL_SECONDS)
        outputs: list[RequestOutput] = []
        for seq in self.scheduler.take_compiled():
            if not seq.is_finished:
                self.postprocessor.jump_at_start(seq)
            if seq.is_finished:  # a failed compile, or an output the grammar fixed entirely
                outputs.append(RequestOutput.from_sequence(seq))
            else:
                self.scheduler.add(seq)
        return outputs
