"""Rounds: how the engine's owner applies a front's commands between two steps, and what it says back.

A front (AsyncEngine) never touches the core. It sends commands (Admit, Abort, Stop, Call), each
naming a request group by the server's id, and settles what comes back: one `Round` per trip,
the admissions decided, the outputs in the order they were made, the core's stats after it all.
The `RoundRunner` applies them and steps. It runs wherever the core lives: in the server's
process on the step's worker thread (trillm/engine/step_thread.py), or in the engine's own
process (trillm/engine/core_process.py); both run the same trips (`trips`), so the two behave
alike. The runner keeps the groups it admitted by id, and forgets one when its last member ends:
a command for a group it does not know (ended meanwhile) is moot and ignored.

Ownership: a runner is driven by one thread at a time, between steps, as the core is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from trillm.engine.core import EngineCore, StepOutput
from trillm.engine.group import RequestGroup
from trillm.engine.stats import EngineStats
from trillm.sched_ext import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admit:
    requests: RequestGroup
    grammars: dict | None = None  # structured-output spec -> its compiled grammar, serialized (a front compiled it)


@dataclass(frozen=True)
class Abort:
    group_id: str
    reason: FinishReason
    indices: list[int] | None = None  # the members to abort (None: all)


@dataclass(frozen=True)
class Stop:
    group_id: str
    index: int  # the member a stop string ended
    reason: FinishReason


@dataclass(frozen=True)
class Call:
    """One of the core's own operations (`CALLS`), between two steps, or beside them (`beside`:
    one the core lets run in any thread while it steps, as loading new weights, which takes
    seconds: the engine's process runs it in a thread of its own); its reply comes back by `call_id`."""

    call_id: int
    method: str
    args: tuple = ()
    beside: bool = False


Command = Admit | Abort | Stop | Call
# what a Call may ask of the core
CALLS = frozenset({"reset_prefix_cache", "sleep", "wake_up", "asleep", "load_lora", "unload_lora", "stage_weights",
                   "swap_staged_weights"})
ABORT_NAMED = "abort_named"  # the one Call the runner answers itself: an abort of every front's groups by name


class Round(msgspec.Struct, gc=False):
    """What one trip decided, for the front to settle: each admission by group id (with its
    error if refused), the outputs by group id in order, the Calls' replies (a result, or the
    error it raised), whether a step ran, and the core's stats after it all; or the error a step
    raised, the engine's death, which the front raises once the rest is settled. A msgspec
    record: it is what the engine's process sends after every trip (its errors pickled there)."""

    admissions: list[tuple[str, Any]] = []  # (group id, None or the Exception that refused it)
    outputs: list[tuple[str, StepOutput]] = []
    replies: list[tuple[int, Any]] = []
    stepped: bool = False
    stats: EngineStats | None = None
    error: Any = None  # an Exception
    notes: list[tuple[str, Any]] = []  # (group id, what an abort by name said about itself)
    adapters: Any = None  # the LoRA adapters' records, after a trip that loaded or unloaded one


def trips(commands: list[Command]) -> list[tuple[list[Command], bool]]:
    """The trips a round makes: admissions get one of their own, so that `add` returns (or is
    refused) without waiting for the step after them; aborts, stops and calls ride with the step."""
    if any(isinstance(command, Admit) for command in commands):
        return [(commands, False), ([], True)]
    return [(commands, True)]


class RoundRunner:
    """Applies commands to a core and steps it; see the module docstring."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._groups: dict[str, RequestGroup] = {}  # group id -> an admitted group with members unfinished
        self._owner: dict[str, RequestGroup] = {}  # engine id -> its group, for every member of those
        self._unfinished: dict[str, int] = {}  # group id -> members without their final output

    def run(self, commands: list[Command], step: bool) -> Round:
        """Apply `commands` in order, then (if `step`) take a step if any request is unfinished.
        Never raises: a refused admission is that group's error, a failed step the round's."""
        done = Round(admissions=[], outputs=[], replies=[])
        for command in commands:
            match command:
                case Admit(requests, grammars):
                    done.admissions.append((requests.request_id, self._admit(requests, grammars)))
                case Abort(group_id, reason, indices) if group_id in self._groups:
                    group = self._groups[group_id]
                    self._emit(done, group, group.abort(self.core, reason, indices))
                case Stop(group_id, index, reason) if group_id in self._groups:
                    group = self._groups[group_id]
                    out = group.stop(self.core, index, reason)
                    self._emit(done, group, [] if out is None else [out])
                case Call(call_id, method, (name, reason, note), False) if method == ABORT_NAMED:
                    done.replies.append((call_id, self._abort_named(done, name, reason, note)))
                case Call(call_id, method, args, beside):
                    assert method in CALLS and not beside, method
                    try:
                        reply = getattr(self.core, method)(*args)
                    except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's death
                        reply = exc
                    done.replies.append((call_id, reply))
        try:
            if step and self.core.has_unfinished():
                for out in self.core.step():
                    group = self._owner[out.request_id]
                    group.on_output(self.core, out)
                    self._emit(done, group, [out])
                done.stepped = True
            done.stats = self.core.stats()
        except Exception as exc:  # noqa: BLE001 - the engine's death, raised by the front once the admissions settle
            done.error = exc
        return done

    def __contains__(self, group_id: str) -> bool:
        """Whether the group with this id is admitted and has members unfinished."""
        return group_id in self._groups

    def _abort_named(self, done: Round, name: str | None, reason: FinishReason, note: dict | None) -> list[str]:
        """Abort the group with the server id `name`, or else every group's members a client named
        so (None: every group), whichever front admitted them; the ids of the groups touched."""
        if name is None:
            targets = [(group, None) for group in self._groups.values()]
        elif name in self._groups:
            targets = [(self._groups[name], None)]
        else:
            targets = [(group, indices) for group in self._groups.values() if (indices := group.named(name))]
        for group, indices in targets:
            if note is not None:
                done.notes.append((group.request_id, note))
            self._emit(done, group, group.abort(self.core, reason, indices))
        return [group.request_id for group, _ in targets]

    def abort_all(self) -> None:
        """Give every request its blocks back (the engine died: no one will end them)."""
        for request_id in list(self._owner):
            self.core.abort_request(request_id)
        self._groups.clear()
        self._owner.clear()
        self._unfinished.clear()

    def _admit(self, requests: RequestGroup, grammars: dict | None) -> Exception | None:
        try:
            if grammars:
                self.core.grammars.insert_serialized(grammars)
            requests.admit(self.core)
        except Exception as exc:  # noqa: BLE001 - one request's refusal (or our bug in admitting it) is not the engine's death
            if not isinstance(exc, ValueError):
                log.exception("request %s: admission failed", requests.request_id)
            return exc
        self._groups[requests.request_id] = requests
        self._unfinished[requests.request_id] = len(requests.members)
        for member in requests.members:
            self._owner[member.request_id] = requests
        return None

    def _emit(self, done: Round, group: RequestGroup, outs: list[StepOutput]) -> None:
        group_id = group.request_id
        for out in outs:
            done.outputs.append((group_id, out))
            if out.finished:
                self._unfinished[group_id] -= 1
        if self._unfinished.get(group_id) == 0:
            del self._groups[group_id], self._unfinished[group_id]
            for member in group.members:
                del self._owner[member.request_id]
