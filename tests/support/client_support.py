"""Models, prompts and checks shared by the local and remote client tests."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field, field_validator

from agent_infer.errors import ValidationRetryError


class Never(BaseModel):
    """Valid JSON for the schema, rejected by its validator every time."""

    word: str = Field(max_length=8)

    @field_validator("word")
    @classmethod
    def reject(cls, v: str) -> str:
        raise ValueError("never good enough")


class Story(BaseModel):
    title: str
    text: str
    tags: list[str] = Field(min_length=1)


# A document the model cannot finish in 40 tokens.
STORY_PROMPT = "Write a very long story about a dragon as JSON with a title, the text and tags."


def check_every_attempt_reported(client: Any) -> None:
    """One re-ask, then a ValidationRetryError carrying both attempts."""
    with pytest.raises(ValidationRetryError) as info:
        client.generate("Say one word.", schema=Never, max_retries=1)
    err = info.value
    assert err.attempts == 2 and len(err.raw_outputs) == 2 and len(err.errors) == 2
    assert all("never good enough" in e for e in err.errors)
    assert all(raw.startswith("{") for raw in err.raw_outputs)
