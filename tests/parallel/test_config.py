"""ParallelConfig checks, how LLM splits its keywords, and a rank that cannot start (a typed error,
not a hang)."""

from __future__ import annotations

import pytest

from agent_infer import LLM
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.errors import ConfigError, RankFailedError
from agent_infer.parallel import ParallelConfig
from agent_infer.parallel.cp_engine import ContextParallelPrefill


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": True}, "data_parallel_size"),
        ({"expert_parallel": "yes"}, "expert_parallel must be a bool"),
        ({"redundant_experts": 2}, "need expert_parallel"),
        ({"eplb_interval": 8}, "need expert_parallel"),
        ({"data_parallel_size": 3, "num_nodes": 2, "expert_parallel": True}, "num_nodes=2 does not divide"),
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
        ({"eplb_weight_source": "disk", "expert_parallel": True}, "eplb_weight_source='disk'"),
        ({"eplb_weight_source": "file"}, "need expert_parallel"),
        ({"data_parallel_size": 2, "cp_prefill_threshold": -1}, "cp_prefill_threshold must be"),
        ({"cp_prefill_threshold": 512}, "needs data_parallel_size >= 2"),
    ],
)
def test_bad_parallel_options_raise_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


def test_cp_threshold_comes_from_the_field_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_CP_PREFILL_THRESHOLD", "2048")
    assert ParallelConfig(data_parallel_size=2).cp_threshold == 2048
    assert ParallelConfig(data_parallel_size=2, cp_prefill_threshold=0).cp_threshold == 0
    assert ParallelConfig(data_parallel_size=2, cp_prefill_threshold=300).cp_threshold == 300
    assert ParallelConfig(expert_parallel=True).cp_threshold == 0  # one rank: nothing to split over
    monkeypatch.setenv("AGENT_INFER_CP_PREFILL_THRESHOLD", "many")
    with pytest.raises(ConfigError, match="AGENT_INFER_CP_PREFILL_THRESHOLD='many' is not an integer"):
        _ = ParallelConfig(data_parallel_size=2).cp_threshold


def test_cp_prefill_needs_an_mla_model(trained_v4: str) -> None:
    """What a rank runs at start: a V4 model (compressed attention) is refused by name."""
    engine = LLMEngine(trained_v4, EngineConfig(kv_cache_memory_bytes=8 * 1024 * 1024))
    with pytest.raises(ConfigError, match=r"context-parallel prefill .* needs a DeepSeek V3 \(MLA\) model"):
        ContextParallelPrefill(engine, 0, 2, 256, lambda job: None)
    assert engine.before_schedule is None


def test_split_kwargs_separates_engine_options() -> None:
    parallel, rest = ParallelConfig.split_kwargs({"data_parallel_size": 2, "block_size": 32})
    assert parallel.data_parallel_size == 2 and parallel.enabled and rest == {"block_size": 32}
    assert not ParallelConfig().enabled


def test_experts_that_do_not_split_over_the_ranks_fail_the_start(model_dir: str) -> None:
    # 8 experts + 1 redundant = 9 slots over 2 ranks
    with pytest.raises(RankFailedError, match=r"9 slots do not split evenly over 2 ranks"):
        LLM(
            model=model_dir,
            data_parallel_size=2,
            expert_parallel=True,
            redundant_experts=1,
            startup_timeout_s=120,
        )
