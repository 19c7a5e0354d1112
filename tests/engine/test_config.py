"""EngineConfig validation: every bad option is a ConfigError naming it."""

from __future__ import annotations

import pytest

from agent_infer.engine.config import EngineConfig
from agent_infer.errors import ConfigError


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float64")
    with pytest.raises(ConfigError, match="max_num_sqs"):
        EngineConfig.from_kwargs(max_num_sqs=4)
