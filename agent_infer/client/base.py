"""What :class:`~agent_infer.client.client.Client` and :class:`~agent_infer.client.async_client.AsyncClient`
share: the backend (local model or remote server), the tool format, usage counting and hooks."""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from agent_infer.client.hooks import (
    NO_HOOKS,
    Hooks,
    check_hooks,
)
from agent_infer.client.local import LocalBackend
from agent_infer.client.remote import RemoteBackend
from agent_infer.client.request import (
    ModelResponse,
    Usage,
)
from agent_infer.client.retry import RetryPolicy
from agent_infer.errors import ConfigError

T = TypeVar("T")
Backend = LocalBackend | RemoteBackend


class ClientBase:
    """What the sync and async clients share: backend selection and usage counting (the logic is in :mod:`call`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        http_retries: int | None = None,
        http_backoff: float | None = None,
        engine: Any = None,
        tool_format: str | None = None,
        hooks: Hooks | None = None,
        **engine_config: Any,
    ) -> None:
        self._hooks = check_hooks(hooks) or NO_HOOKS
        self._backend: Backend | None = None
        self._backend_lock = threading.Lock()
        self._model = model
        self._tool_format = tool_format
        self._usage = Usage()
        self._usage_lock = threading.Lock()
        if base_url is not None:
            if engine is not None or engine_config or tool_format is not None:
                raise ConfigError(
                    "engine, engine options and tool_format apply to local models, not base_url"
                )
            retry = RetryPolicy(
                2 if http_retries is None else http_retries, 0.5 if http_backoff is None else http_backoff
            )
            self._backend = RemoteBackend(
                base_url, model or "default", api_key=api_key, timeout=timeout, retry=retry
            )
        elif http_retries is not None or http_backoff is not None:
            raise ConfigError("http_retries and http_backoff apply to remote servers (base_url)")
        elif engine is not None:
            if model is not None or engine_config:
                raise ConfigError("give either engine= or model=/engine options, not both")
            self._backend = LocalBackend(engine, self._format())
        elif api_key is not None:
            raise ConfigError("api_key needs base_url (a local model takes no key)")
        else:
            from agent_infer.engine.config import EngineConfig

            # Checked now so a misspelt option fails here, not at the first call.
            self._config = EngineConfig.from_kwargs(**engine_config)

    @classmethod
    def from_llm(cls: type[T], llm: Any, *, tool_format: str | None = None) -> T:
        """A client on an existing :class:`~agent_infer.LLM` (shares its engine and loaded weights).

        The client steps that engine from its own thread: do not call ``llm.generate`` at the same
        time, or each would consume the other's outputs. For both at once, build a second engine on
        the same weights (``LLMEngine(loaded=llm.engine.loaded)``).
        """
        return cls(engine=llm.engine, tool_format=tool_format)  # type: ignore[call-arg]

    def _format(self) -> Any:
        if self._tool_format is None:
            return None
        from agent_infer.tool_formats import get_format

        return get_format(self._tool_format)

    @property
    def backend(self) -> Backend:
        """The local or remote backend (a local model is loaded here, on first use)."""
        with self._backend_lock:
            if self._backend is None:
                from agent_infer.engine.llm_engine import LLMEngine

                engine = LLMEngine(self._model, self._config)
                self._backend = LocalBackend(engine, self._format())
            return self._backend

    @property
    def is_remote(self) -> bool:
        """True when calls go to a server."""
        return isinstance(self._backend, RemoteBackend)

    @property
    def usage(self) -> Usage:
        """Tokens used by every call of this client so far."""
        return self._usage

    def _count(self, usage: Usage | None) -> None:
        if usage is not None:
            with self._usage_lock:
                self._usage = self._usage + usage

    def _counted(self, response: ModelResponse) -> ModelResponse:
        self._count(response.usage)
        return response

    def _hooks_for(self, hooks: Hooks | None) -> Hooks:
        """The client's hooks, then the call's."""
        return self._hooks.then(check_hooks(hooks))
