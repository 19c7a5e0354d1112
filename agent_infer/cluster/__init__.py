"""Serving beyond one replica: local replica and sglang-router processes, prefill/decode handoff."""
