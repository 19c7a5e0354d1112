"""The OpenAI-compatible HTTP server: ``create_app(engine, ServerConfig(...))`` or ``agent-infer serve``."""

from __future__ import annotations

from agent_infer.server.app import create_app, serve, served_name
from agent_infer.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve", "served_name"]
