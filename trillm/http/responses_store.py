"""The stored responses behind `store: true`: GET, DELETE, input_items, cancel, previous_response_id.

A bounded LRU (`--responses-store-size` responses); an evicted or unknown id is a 404 that names
it. Stored records are the response object as last reported, its input items, and the
conversation up to and with its answer (chat messages), which a later request's
`previous_response_id` replays as its prompt's first turns, so the prefix cache serves them.

Two homes, one interface (every operation awaited, on the event loop):
- ResponseStore: in this process's memory (one front);
- SharedResponseStore: an SQLite file that every front writes (`--api-server-count`), in the
  fronts' 0700 directory, read and written in worker threads. A response runs in the front that
  made it, which holds its live record (a GET there sees its progress); the file has its record
  as it was queued and as it ended, so any front may fetch, page, cancel or delete it.
"""
from __future__ import annotations

import pickle
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from trillm.http.errors import APIError
from trillm.http.protocol.chat import ChatMessage

POLL_S = 0.02  # how often a front asks the file whether another front's response has ended
BUSY_TIMEOUT_MS = 10_000  # how long a write waits for another front's


@dataclass(eq=False)
class StoredResponse:
    response: dict  # the response object; a running background one is updated as it runs
    input_items: list[dict]  # as given, each with an id
    conversation: list[ChatMessage]  # earlier turns, this input, and (once done) the answer
    done: trio.Event = field(default_factory=trio.Event)  # set when it ended, whatever its status

    @property
    def running(self) -> bool:
        return not self.done.is_set()


def _missing(response_id: str, param: str) -> APIError:
    return APIError(404, f"No stored response has id {response_id!r} (unknown, deleted or evicted).", param)


class ResponseStore:
    """In this process's memory; only the event loop touches it (no locks)."""

    def __init__(self, capacity: int):
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    async def put(self, stored: StoredResponse) -> None:
        """Keep (or refresh) a response, evicting the least recently used beyond the capacity."""
        response_id = stored.response["id"]
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    async def update(self, stored: StoredResponse) -> None:
        """Refresh a response that is still stored (one deleted or evicted meanwhile stays gone)."""
        if stored.response["id"] in self._items:
            await self.put(stored)

    async def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, now the most recently used; a 404 naming the id otherwise."""
        stored = self._items.get(response_id)
        if stored is None:
            raise _missing(response_id, param)
        self._items.move_to_end(response_id)
        return stored

    async def delete(self, response_id: str) -> StoredResponse:
        stored = await self.get(response_id)
        del self._items[response_id]
        return stored

    async def ended(self, stored: StoredResponse) -> StoredResponse:
        """The response once it has ended, as it ended."""
        await stored.done.wait()
        return stored

    def close(self) -> None:
        """Nothing to close (SharedResponseStore's counterpart)."""


class SharedResponseStore:
    """In an SQLite file every front shares (module docstring); one connection a process, used by
    one worker thread at a time (a lock), the file's own locks between processes."""

    def __init__(self, path: str, capacity: int, off_loop):
        """`off_loop(fn, *args)`: how this front runs work away from its event loop (ServerState.off_loop)."""
        assert capacity >= 0
        self.capacity = capacity
        self._off_loop = off_loop
        self._live: dict[str, StoredResponse] = {}  # responses running in this front, their records live
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                                   isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, record BLOB NOT NULL, "
                             "done INTEGER NOT NULL, used INTEGER NOT NULL)")

    async def put(self, stored: StoredResponse) -> None:
        """Keep (or refresh) a response, evicting the least recently used beyond the capacity."""
        self._follow(stored)
        await self._off_loop(self._write, stored.response["id"], _parts(stored), stored.done.is_set(), False)

    async def update(self, stored: StoredResponse) -> None:
        """Refresh a response that is still stored (one deleted or evicted meanwhile stays gone)."""
        self._follow(stored)
        await self._off_loop(self._write, stored.response["id"], _parts(stored), stored.done.is_set(), True)

    async def get(self, response_id: str, param: str = "response_id", delete: bool = False) -> StoredResponse:
        """The stored response (this front's live record of one it runs), now the most recently
        used (or, `delete`, no longer stored); a 404 naming the id otherwise."""
        row = await self._off_loop(self._read, response_id, delete)
        if row is None:
            raise _missing(response_id, param)
        return self._live.get(response_id) or _stored(*row)

    async def delete(self, response_id: str) -> StoredResponse:
        return await self.get(response_id, delete=True)

    async def ended(self, stored: StoredResponse) -> StoredResponse:
        """The response once it has ended, as it ended: this front's own at once, another front's
        once the file says so (a deleted one as it was)."""
        while stored.running:
            if stored.response["id"] in self._live:
                await stored.done.wait()
                break
            await trio.sleep(POLL_S)
            row = await self._off_loop(self._read, stored.response["id"], False)
            if row is None:
                break
            stored = _stored(*row)
        return stored

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _follow(self, stored: StoredResponse) -> None:
        if stored.running:
            self._live[stored.response["id"]] = stored
        else:
            self._live.pop(stored.response["id"], None)

    def _write(self, response_id: str, parts: tuple, done: bool, only_if_stored: bool) -> None:
        # pickled: read back only by this server's fronts, from a file in their 0700 directory
        record = pickle.dumps(parts)
        with self._lock, self._db:  # one transaction
            self._db.execute("BEGIN IMMEDIATE")
            if only_if_stored:
                self._db.execute("UPDATE responses SET record = ?, done = ? WHERE id = ?", (record, done, response_id))
            else:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, "
                                 "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses))", (response_id, record, done))
                self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY used DESC "
                                 "LIMIT -1 OFFSET ?)", (self.capacity,))

    def _read(self, response_id: str, delete: bool) -> tuple[tuple, bool] | None:
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT record, done FROM responses WHERE id = ?", (response_id,)).fetchone()
            if row is not None:
                if delete:
                    self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                else:
                    self._db.execute("UPDATE responses SET used = (SELECT MAX(used) + 1 FROM responses) WHERE id = ?",
                                     (response_id,))
        return None if row is None else (pickle.loads(row[0]), bool(row[1]))


def _parts(stored: StoredResponse) -> tuple:
    """What the file keeps of a response (taken on the loop; pickled in a worker thread)."""
    return stored.response, stored.input_items, stored.conversation


def _stored(parts: tuple, done: bool) -> StoredResponse:
    stored = StoredResponse(*parts)
    if done:
        stored.done.set()
    return stored
