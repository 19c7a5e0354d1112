"""Settings of the OpenAI-compatible server, fixed when the app is built."""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.errors import ConfigError
from agent_infer.server.reasoning import check_reasoning_parser


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server behaves.

    ``api_key`` of None leaves ``/v1`` open (the default bind address is loopback, so only local
    processes can reach it). ``model_name`` is the id served by ``/v1/models`` and required in the
    ``model`` field of requests (None: the model file's name). ``max_body_bytes`` bounds a request
    body (413 beyond it); ``max_tokens_limit`` bounds ``max_tokens`` and is the default when a
    request gives none. ``tool_format`` names a tool-call format (None: detected from the chat
    template). ``reasoning_parser`` (``"deepseek_r1"``; None: off) splits the model's
    ``<think>...</think>`` thinking into ``reasoning_content`` and constrains only the answer
    (``agent_infer.server.reasoning``). ``disaggregation_mode`` (SGLang's names): ``"prefill"`` or
    ``"decode"`` make this server one half of a prefill/decode pair behind sglang-router's PD mode
    (``agent_infer.server.pd``); ``"null"`` serves whole requests.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 2 * 1024 * 1024
    max_tokens_limit: int = 4096
    tool_format: str | None = None
    reasoning_parser: str | None = None
    disaggregation_mode: str = "null"

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ConfigError(
                f"disaggregation_mode must be 'null', 'prefill' or 'decode', got {self.disaggregation_mode!r}"
            )
        for name in ("max_body_bytes", "max_tokens_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be an integer in [0, 65535], got {self.port!r}")
        check_reasoning_parser(self.reasoning_parser)
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must be a non-empty string or None")
