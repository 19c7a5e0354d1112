"""The offline entry point: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(...)``."""

from __future__ import annotations

import itertools
from typing import Any

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.output import RequestOutput
from agent_infer.errors import InvalidRequestError
from agent_infer.model.tokenizer import Tokenizer
from agent_infer.parallel import DataParallelEngine, ParallelConfig
from agent_infer.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Loads a model once and runs batches of prompts to completion.

    ``model`` is a GGUF file or Hugging Face directory (None: the default SmolLM2-135M-Instruct).
    Keyword arguments are :class:`EngineConfig` fields (e.g. ``async_scheduling``,
    ``forced_tokens``, ``grammar_workers`` for structured generation); an unknown one raises
    ``ConfigError``.

    :class:`~agent_infer.parallel.ParallelConfig` fields (``data_parallel_size``,
    ``expert_parallel``, ``redundant_experts``, ``eplb_interval``, ...) start that many rank
    processes behind a :class:`~agent_infer.parallel.DataParallelEngine` instead; :meth:`close`
    stops them.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        parallel, rest = ParallelConfig.split_kwargs(config)
        self.engine: LLMEngine | DataParallelEngine
        if parallel.enabled:
            self.engine = DataParallelEngine(model, EngineConfig.from_kwargs(**rest), parallel)
        else:
            self.engine = LLMEngine(model, EngineConfig.from_kwargs(**rest))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the rank processes of a data-parallel engine (nothing to do for one process)."""
        if isinstance(self.engine, DataParallelEngine):
            self.engine.shutdown()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one sharing already-loaded weights with another)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[int],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); results come back in prompt order."""
        if isinstance(prompts, str):
            batch: list[Any] = [prompts]
        elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            batch = [prompts]  # a single prompt given as token ids
        else:
            batch = list(prompts)
        return self._run(batch, params)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several; the chat template is applied."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", field="messages")
        conversations: list[Any] = [messages] if isinstance(messages[0], dict) else list(messages)
        return self._run(conversations, params)

    def _run(
        self, prompts: list[Any], params: SamplingParams | list[SamplingParams] | None
    ) -> list[RequestOutput]:
        if not prompts:
            raise InvalidRequestError("no prompts given", field="prompts")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params)} SamplingParams for {len(prompts)} prompts", field="params"
                )
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            # All-or-nothing: a bad prompt must not leave its siblings running in the engine.
            for request_id in ids:
                self.engine.abort(request_id)
            self._drain(set(ids))
            raise
        return self._drain(set(ids), ids)

    def _drain(self, wanted: set[str], order: list[str] | None = None) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(wanted) and self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[i] for i in order] if order is not None else []
