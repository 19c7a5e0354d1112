"""A server's half of a prefill/decode pair, by ``--disaggregation-mode``."""

from __future__ import annotations

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.server.pd.decode import DecodeRole
from agent_infer.server.pd.prefill import PrefillRole
from agent_infer.server.pd.transfer import Transfer


def make_pd_role(mode: str, engine: LLMEngine, host: str) -> PrefillRole | DecodeRole:
    """The role for ``mode`` ("prefill" or "decode"), its transfer engine listening on ``host``."""
    transfer = Transfer(host)
    return PrefillRole(engine, transfer) if mode == "prefill" else DecodeRole(engine, transfer)
