"""FrontLinks: the engine's process's sockets to each of its fronts (`--api-server-count`).

Each front (an AsyncEngine in a front process, over trillm/engine/core_process.py's EngineLink)
binds a pair of sockets; this side connects one PULL for its commands and one PUSH for its
Rounds to each pair. A command's front is the socket it came on: an Admit makes that front the
group's owner, and the group's admission and outputs go back to it alone; a Call's reply goes to
the front that asked (its id is made unique here, since each front counts its own). Aborts and
stops name a group by the server's id, unique across fronts: any front may send them. A front
with nothing in a Round gets the stats alone, at most every STATS_EVERY_S while the engine steps,
and always once it goes idle, so that every front's gauges and waiting limit follow the engine.
With front 0 alone, commands and Rounds pass as they are: nothing to route.

Ownership: the engine's loop thread alone (ZeroMQ sockets belong to one thread each).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import replace

import msgspec
import zmq

from trillm.engine.rounds import Admit, Call, Command, Round, RoundRunner
from trillm.engine.wire import STOP, round_encoder

LINGER_MS = 5000  # how long a closing socket may still try to deliver (the last Round, a reply)
STATS_EVERY_S = 0.05  # the stats' age at most, at a front that has nothing in a Round, while the engine steps


class FrontLinks:
    def __init__(self, context: zmq.Context, addresses: list[tuple[str, str]]):
        """`addresses`: each front's (commands, rounds) pair, front 0 first (the one that
        started this process, and the only one that stops it)."""
        self._commands = []
        self._rounds = []
        for front, (commands_address, rounds_address) in enumerate(addresses):
            commands, rounds = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            for sock in (commands, rounds):
                sock.setsockopt(zmq.LINGER, LINGER_MS)
            if front:
                # A Round for another front never waits: were that front dead, a full queue would
                # stop every front's steps until the server has stopped (a front's death stops it).
                rounds.setsockopt(zmq.SNDHWM, 0)
            commands.connect(commands_address)
            rounds.connect(rounds_address)
            self._commands.append(commands)
            self._rounds.append(rounds)
        self.rounds_addresses = [rounds for _, rounds in addresses]
        self._poller = zmq.Poller()
        for commands in self._commands:
            self._poller.register(commands, zmq.POLLIN)
        self._encoder = round_encoder()
        self._several = len(addresses) > 1  # with front 0 alone, commands and Rounds pass as they are
        self._owners: dict[str, int] = {}  # group id -> the front that admitted it, while the runner holds it
        self._calls: dict[int, tuple[int, int]] = {}  # this side's call id -> (front, the front's call id)
        self._call_ids = 0
        self._stats_sent = [0.0] * len(addresses)  # when each front last had a Round

    def close(self) -> None:
        """Close the sockets: front 0's after what it was sent is delivered (its last Round may carry
        a step's error), the others' at once (they have ended: front 0 stops the engine last)."""
        for front, sock in enumerate(self._rounds):
            sock.close(linger=LINGER_MS if front == 0 else 0)
        for sock in self._commands:
            sock.close(linger=0)

    def send_first(self, message: bytes) -> None:
        """READY or FAILED, to front 0 (the others start once it is ready)."""
        self._rounds[0].send(message)

    def receive(self, wait: bool) -> list[Command] | None:
        """Every queued command, each front's in the order it sent them (waiting for one first if
        `wait`); None once front 0 says STOP. A Call's id is this side's from here on (`send`
        and `reply_address` give the front's back)."""
        if wait:
            self._poller.poll()
        received = []
        for front, commands in enumerate(self._commands):
            while True:
                try:
                    message = commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message == STOP:
                    assert front == 0, "only the front that started the engine stops it"
                    return None
                command = pickle.loads(message)
                received.append(self._follow(front, command) if self._several else command)
        return received

    def _follow(self, front: int, command: Command) -> Command:
        """Note where a command came from: an Admit's group is that front's; a Call gets an id of
        this side's, unique across fronts."""
        if isinstance(command, Admit):
            self._owners[command.requests.request_id] = front
        elif isinstance(command, Call):
            self._call_ids += 1
            self._calls[self._call_ids] = (front, command.call_id)
            command = replace(command, call_id=self._call_ids)
        return command

    def reply_address(self, call_id: int) -> tuple[str, int]:
        """Where a Call beside the steps replies (its front's rounds address) and under which id;
        the call is forgotten here."""
        front, front_call_id = self._calls.pop(call_id) if self._several else (0, call_id)
        return self.rounds_addresses[front], front_call_id

    def send(self, done: Round, runner: RoundRunner, idle: bool) -> None:
        """Each front its part of `done`: its groups' admissions and outputs, its calls' replies;
        the rest (stats, stepped, error, adapters) to each. `idle`: the engine waits for commands
        next, so every front gets the stats now."""
        if not self._several:  # front 0's Round, as the runner made it: no copy on the step's path
            self._rounds[0].send(self._encoder.encode(done), copy=False)
            return
        parts = [Round(admissions=[], outputs=[], replies=[], stepped=done.stepped, stats=done.stats,
                       error=done.error, notes=[], adapters=done.adapters) for _ in self._rounds]
        for group_id, error in done.admissions:
            parts[self._owners[group_id]].admissions.append((group_id, error))
        for group_id, out in done.outputs:
            parts[self._owners[group_id]].outputs.append((group_id, out))
        for group_id, note in done.notes:
            parts[self._owners[group_id]].notes.append((group_id, note))
        # Refused, or its last member's final output went out (an abort may end a group in the
        # trip that admitted it: each id once).
        for group_id in {group_id for group_id, _ in done.admissions} | {
                group_id for group_id, out in done.outputs if out.finished}:
            if group_id not in runner:
                del self._owners[group_id]
        for call_id, reply in done.replies:
            front, front_call_id = self._calls.pop(call_id)
            parts[front].replies.append((front_call_id, reply))
        now = time.monotonic()
        for front, part in enumerate(parts):
            if (idle or part.admissions or part.outputs or part.replies or part.error is not None
                    or part.adapters is not None or now - self._stats_sent[front] >= STATS_EVERY_S):
                self._rounds[front].send(self._encoder.encode(part), copy=False)
                self._stats_sent[front] = now


def replied(call_id: int, reply: msgspec.msgpack.Ext) -> bytes:
    """A Round carrying one reply alone (a Call beside the steps), encoded."""
    return round_encoder().encode(Round(admissions=[], outputs=[], replies=[(call_id, reply)]))
