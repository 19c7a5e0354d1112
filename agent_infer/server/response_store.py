"""Finished Responses API responses, kept in server memory for ``previous_response_id``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from agent_infer.server.errors import ApiError

#: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``.
MAX_STORED = 1024


class ResponseStore:
    """Finished responses by id (bounded, least recently used out): body and full transcript."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, body: dict[str, Any], transcript: list[dict[str, Any]]) -> None:
        """Keep ``body`` and the messages that lead to and include its output."""
        self._items[body["id"]] = (body, transcript)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The stored response, or a 404 naming ``param``."""
        found = self._items.get(response_id)
        if found is None:
            raise ApiError(
                404, f"no stored response with id {response_id!r}", param=param, code="response_not_found"
            )
        self._items.move_to_end(response_id)
        return found
