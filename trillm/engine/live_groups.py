"""LiveGroups: the engine's index of live request groups, which is what routes an abort.

A group is live from the moment `AsyncEngine.add` registers it until its last member's final
output is sent (or its admission is refused, or the engine dies). The index finds it by the
server's id (unique: how a Round's outputs find their channel), and by a client's own id for it
(not unique: two live groups may share one; a batch may name each prompt). It also counts the
members still without their final output, for the waiting limit.

Ownership: the Trio thread alone reads and changes it (handlers and the engine task both run
there), so it needs no lock.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from trillm.engine.group import RequestGroup


@dataclass(eq=False)
class LiveGroup:
    """One client request's engine requests, and the channel that carries all their outputs."""

    requests: RequestGroup
    send: trio.MemorySendChannel
    admitted: trio.Event = field(default_factory=trio.Event)
    error: Exception | None = None
    unfinished: int = 0  # members whose final output has not been sent yet
    # What an abort said about itself (LMDeploy's and SGLang's finished_reason / abort_message),
    # for the routes that report it; set when the abort is asked for, before it is applied.
    abort_note: dict | None = None

    @property
    def client_ids(self) -> set[str]:
        return {m.client_id for m in self.requests.members if m.client_id is not None}

    @property
    def request_id(self) -> str:
        return self.requests.request_id


class LiveGroups:
    def __init__(self) -> None:
        self._by_id: dict[str, LiveGroup] = {}  # server id -> group
        self._by_client_id: dict[str, list[LiveGroup]] = {}  # client id -> its live groups, oldest first
        # Members without their final output: queued for admission, deferred behind a repeated
        # prompt, or waiting or running in the core.
        self.unfinished_members = 0
        self.idle = trio.Event()  # set while no group is live; a fresh one once a group registers
        self.idle.set()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[LiveGroup]:
        return iter(list(self._by_id.values()))

    def __contains__(self, group: LiveGroup) -> bool:
        return self._by_id.get(group.request_id) is group

    def get(self, request_id: str) -> LiveGroup:
        """The live group with this server id (KeyError otherwise)."""
        return self._by_id[request_id]

    def named(self, request_id: str) -> list[tuple[LiveGroup, list[int] | None]]:
        """What an abort of `request_id` reaches: the group with that server id (all of it), or
        else each live group a client named so, with the members that carry the name (None: all)."""
        group = self._by_id.get(request_id)
        if group is not None:
            return [(group, None)]
        return [(g, g.requests.named(request_id)) for g in self._by_client_id.get(request_id, ())]

    def register(self, group: LiveGroup) -> None:
        assert group.request_id not in self._by_id, "the server's request ids are unique"
        self._by_id[group.request_id] = group
        for client_id in group.client_ids:
            self._by_client_id.setdefault(client_id, []).append(group)
        if self.idle.is_set():
            self.idle = trio.Event()
        self.unfinished_members += group.unfinished

    def member_finished(self, group: LiveGroup) -> bool:
        """Count one member's final output; True when it was the group's last (the caller then
        closes its channel and unregisters it)."""
        group.unfinished -= 1
        self.unfinished_members -= 1
        return group.unfinished == 0

    def unregister(self, group: LiveGroup) -> None:
        assert group in self
        del self._by_id[group.request_id]
        for client_id in group.client_ids:
            named = self._by_client_id[client_id]
            named.remove(group)
            if not named:
                del self._by_client_id[client_id]
        self.unfinished_members -= group.unfinished  # a refused group's members, never finished
        if not self._by_id:
            self.idle.set()

    def clear(self) -> list[LiveGroup]:
        """Forget every group (the engine died); returns them, for their owner to fail."""
        groups = list(self._by_id.values())
        self._by_id.clear()
        self._by_client_id.clear()
        self.unfinished_members = 0
        self.idle.set()
        return groups
