"""The host KV tier: evicted prefix blocks come back on a prefix hit, with a cold run's logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent_infer.engine.config import EngineConfig
from agent_infer.errors import ConfigError
from agent_infer.sampling_params import SamplingParams

# A pool of 40 blocks (640 tokens) holds one agent's prompt but not three of them.
POOL = {"num_kv_blocks": 40, "speculative_tokens": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)


def _agent(i: int) -> list[dict[str, str]]:
    rules = " ".join(f"Rule {k}: agent {i} must handle case {k * 13 + i} carefully." for k in range(22))
    return [
        {"role": "system", "content": f"You are tool-using agent number {i}. {rules}"},
        {"role": "user", "content": "What is your first step?"},
    ]


def _run(llm: Any, messages: list[dict[str, str]]) -> Any:
    return llm.chat(messages, GREEDY)[0]


def _churn(llm: Any) -> None:
    """Other agents' prompts, enough to evict agent 0's blocks from the device pool."""
    for i in (1, 2, 3):
        _run(llm, _agent(i))


def test_a_restored_prefix_gives_the_cold_runs_tokens_and_logprobs(make_llm: Callable[..., Any]) -> None:
    tiered = make_llm(**POOL, host_kv_cache_bytes=64 << 20)
    tier = tiered.engine.block_manager.tier
    assert tier is not None
    cold = _run(tiered, _agent(0))
    assert cold.num_cached_tokens == 0
    _churn(tiered)
    assert tier.stats.offloaded > 0
    warm = _run(tiered, _agent(0))
    assert tier.stats.restored > 0
    # Whole blocks of the prompt came back from the tier (the last token is always recomputed).
    prompt_len = len(cold.prompt_token_ids)
    assert warm.num_cached_tokens == (prompt_len - 1) // 16 * 16
    assert warm.token_ids == cold.token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs


def test_without_the_tier_the_evicted_prefix_is_recomputed(make_llm: Callable[..., Any]) -> None:
    plain = make_llm(**POOL)
    assert plain.engine.block_manager.tier is None
    cold = _run(plain, _agent(0))
    _churn(plain)
    again = _run(plain, _agent(0))
    assert again.num_cached_tokens == 0
    assert again.token_ids == cold.token_ids


def test_tier_smaller_than_a_block_is_a_config_error(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="smaller than one KV block"):
        make_llm(**POOL, host_kv_cache_bytes=1)


def test_bounded_tier_drops_oldest_and_counts_it(make_llm: Callable[..., Any]) -> None:
    probe = make_llm(**POOL, host_kv_cache_bytes=64 << 20)
    block_bytes = probe.engine.block_manager.tier.block_bytes
    small = make_llm(**POOL, host_kv_cache_bytes=8 * block_bytes)
    tier = small.engine.block_manager.tier
    assert tier.capacity_blocks == 8 and tier.capacity_bytes == 8 * block_bytes
    _run(small, _agent(0))
    _churn(small)
    assert len(tier) == 8
    assert tier.stats.dropped == tier.stats.offloaded - 8 > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"host_kv_cache_bytes": -1}, "must be >= 0"),
        ({"host_kv_cache_bytes": True}, "must be an int"),
        ({"host_kv_cache_bytes": 1 << 20, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ],
)
def test_bad_tier_settings_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)


def test_flush_clears_the_tier(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(**POOL, host_kv_cache_bytes=64 << 20)
    _run(llm, _agent(0))
    _churn(llm)
    tier = llm.engine.block_manager.tier
    held = len(tier)
    assert held > 0
    assert llm.engine.block_manager.reset_prefix_cache() >= held
    assert len(tier) == 0
    assert _run(llm, _agent(0)).num_cached_tokens == 0
