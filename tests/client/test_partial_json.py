"""The streaming JSON parser: every snapshot is a prefix-consistent view of the final value."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, field_validator

from agent_infer.client.partial_json import (
    PartialJSON,
    PartialJSONError,
    is_prefix_of,
    model_to_python,
    partial_model,
)
from agent_infer.errors import AgentInferError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(json_values, st.sampled_from([None, 1]), st.booleans(), st.integers(1, 7))
def test_every_split_gives_prefix_views(value: Any, indent: int | None, ascii_only: bool, step: int) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    parser = PartialJSON()
    for i in range(0, len(text), step):
        parser.feed(text[i : i + step])
        snap = parser.snapshot()
        if snap is not None:
            assert is_prefix_of(snap, value), (text[: i + step], snap)
    assert parser.finish() == value


def test_numbers_and_keys_appear_only_when_complete() -> None:
    parser = PartialJSON()
    parser.feed('{"count": 12')
    assert parser.snapshot() == {}  # 12 may still become 123
    parser.feed('3, "na')
    assert parser.snapshot() == {"count": 123}  # a half key is not shown
    parser.feed('me": "Al')
    assert parser.snapshot() == {"count": 123, "name": "Al"}
    assert not parser.done
    parser.feed('ice"}  ')
    assert parser.done and parser.finish() == {"count": 123, "name": "Alice"}


@pytest.mark.parametrize(
    ("text", "position"),
    [('{"a" 1}', 5), ("[1,,2]", 3), ('{"a": tru}', 9), ('"\\x"', 2), ("{} x", 3), ("]", 0)],
)
def test_bad_json_names_the_position(text: str, position: int) -> None:
    parser = PartialJSON()
    with pytest.raises(PartialJSONError) as info:
        parser.feed(text)
    assert info.value.position == position
    assert isinstance(info.value, AgentInferError)


def test_incomplete_value_at_finish_is_an_error() -> None:
    parser = PartialJSON()
    parser.feed('{"a": [1, 2')
    with pytest.raises(PartialJSONError, match="incomplete"):
        parser.finish()


class Color(str, Enum):
    RED = "red"
    BLUE = "blue"


class Item(BaseModel):
    label: str
    color: Color

    @field_validator("label")
    @classmethod
    def long_enough(cls, v: str) -> str:
        if len(v) < 3:
            raise ValueError("label too short")
        return v


class Order(BaseModel):
    title: str
    items: list[Item]
    note: str | None = Field(default="none")


def test_partial_models_validate_only_closed_subtrees() -> None:
    final = {
        "title": "Groceries",
        "items": [{"label": "apples", "color": "red"}, {"label": "figs", "color": "blue"}],
    }
    text = json.dumps(final)
    parser = PartialJSON()
    seen: list[Any] = []
    for ch in text:
        parser.feed(ch)
        if parser.root is not None:
            partial = partial_model(parser.root, Order)
            view = model_to_python(partial)
            assert is_prefix_of(view, final), view
            seen.append(partial)
    # While "ap" is being written the validator (len >= 3) would fail: open strings are not validated.
    half = next(p for p in seen if getattr(p, "items", None) and p.items[0].__dict__.get("label") == "ap")
    assert isinstance(half, Order) and isinstance(half.items[0], Item)
    # A closed item is a validated instance with its enum converted.
    done_item = seen[-1].items[0]
    assert isinstance(done_item, Item) and done_item.color is Color.RED
    # A field that has not arrived is absent, not its default.
    assert "note" not in seen[-2].model_fields_set and getattr(seen[-2], "note", "absent") == "absent"
    assert Order.model_validate(parser.finish()) == Order.model_validate(final)
