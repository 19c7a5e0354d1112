"""Speculative decoding's settings: engine options and per-request overrides, each bad value a typed
error naming it."""

from __future__ import annotations

import pytest

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.errors import ConfigError, InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"speculative_tokens": 33}, "speculative_tokens"),
        ({"speculative_tokens": -1}, "speculative_tokens"),
        ({"speculative_confidence": -0.1}, "speculative_confidence"),
        ({"speculative_confidence": 1.5}, "speculative_confidence"),
        ({"speculative_source": "eagle"}, "speculative_source"),
    ],
)
def test_engine_options_are_checked(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_engine_defaults() -> None:
    c = EngineConfig()
    assert c.speculative_tokens == 5 and c.speculative_source is None and 0 < c.speculative_confidence < 1
    assert EngineConfig(speculative_tokens=32, speculative_confidence=0.0).speculative_tokens == 32


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speculative_source": "mtp2"}, "speculative_source"),
        ({"speculative_tokens": 33}, "speculative_tokens"),
        ({"speculative_tokens": 1.5}, "speculative_tokens"),
        ({"speculative_confidence": -1.0}, "speculative_confidence"),
        ({"speculative_confidence": float("nan")}, "speculative_confidence"),
    ],
)
def test_request_overrides_are_checked(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
