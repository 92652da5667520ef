"""The stored responses behind `store: true`: GET, DELETE, input_items, cancel, previous_response_id.

A bounded LRU in memory (`--responses-store-size` responses); an evicted or unknown id is a 404
that names it. Stored records are the response object as last reported, its input items, and
the conversation up to and with its answer (chat messages), which a later request's
`previous_response_id` replays as its prompt's first turns, so the prefix cache serves them.
Only the event loop touches the store (no locks).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from trillm.http.errors import APIError
from trillm.http.protocol.chat import ChatMessage


@dataclass(eq=False)
class StoredResponse:
    response: dict  # the response object; a running background one is updated as it runs
    input_items: list[dict]  # as given, each with an id
    conversation: list[ChatMessage]  # earlier turns, this input, and (once done) the answer
    done: trio.Event = field(default_factory=trio.Event)  # set when it ended, whatever its status

    @property
    def running(self) -> bool:
        return not self.done.is_set()


class ResponseStore:
    def __init__(self, capacity: int):
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        """Keep (or refresh) a response, evicting the least recently used beyond the capacity."""
        response_id = stored.response["id"]
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, now the most recently used; a 404 naming the id otherwise."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"No stored response has id {response_id!r} (unknown, deleted or evicted).", param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self._items[response_id]
        return stored
