"""ParallelConfig checks, how LLM splits its keywords, and a rank that cannot start (a typed error,
not a hang)."""

from __future__ import annotations

import pytest

from agent_infer import LLM
from agent_infer.errors import ConfigError, RankFailedError
from agent_infer.parallel import ParallelConfig


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
    ],
)
def test_bad_parallel_options_raise_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


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
