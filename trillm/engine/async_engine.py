"""AsyncEngine: the Trio front of the engine core.

One Trio task (`run`, started in the app's nursery) drives the core's link: StepThread (the core
in this process, its rounds on the step's worker thread: trillm/engine/step_thread.py) or
EngineLink (the core in a process of its own: trillm/engine/core_process.py). Handlers never
touch the core: they send commands (admissions, aborts, stops: trillm/engine/rounds.py), named by
the group's id, and read their outputs from a memory channel; the engine task settles each Round
that comes back (channels fed, refused groups ended). A command is applied between two steps,
so an abort is clean: the request's blocks are free before the next step.

A client request may need several engine requests: `n` samples of a prompt, or a
list of prompts. They form one `RequestGroup` (trillm/engine/group.py: the fan-out,
and the admission that lets repeated prompts share their cached blocks), with one id
that the server made (unique), maybe a client's own id for it (not unique: two live
groups may share one), and one channel that carries all their outputs. `abort`
takes either id.

Channels are unbounded: the engine task must never wait on a slow reader. Their
size is bounded anyway, by each request's max_tokens.
"""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import trio

from trillm.config import EngineArgs
from trillm.engine.admission import Admission
from trillm.engine.core import EngineCore, StepOutput
from trillm.engine.core_process import EngineLink
from trillm.engine.errors import EngineUnavailableError
from trillm.engine.group import RequestGroup
from trillm.engine.live_groups import LiveGroup, LiveGroups
from trillm.engine.rounds import ABORT_NAMED, Abort, Call, Round, Stop
from trillm.engine.stats import ServingStats
from trillm.engine.step_thread import StepThread
from trillm.engine.weight_cycle import WeightCycle
from trillm.model.loader import ModelConfig
from trillm.model.lora import LoRAAdapter
from trillm.sched_ext import FinishReason

log = logging.getLogger(__name__)

CHECK_THREADS = 2  # requests checked at once before they queue (AsyncEngine.add)


@dataclass(eq=False)
class PendingCall:
    """A Call sent to the core, until its reply (a result, or the error it raised) is in."""

    done: trio.Event = field(default_factory=trio.Event)
    reply: object = None


class RequestStream:
    """A group's outputs, as `(member index, StepOutput)` pairs, until every member has finished.
    A member's outputs that have all arrived when it is read come as one (StepOutput.then): a
    reader that fell behind the engine catches up in one write, not one per step.

    Closing it (always do, in `finally`) aborts whatever of the group still runs;
    closing twice is harmless.
    """

    def __init__(self, engine: AsyncEngine, group: LiveGroup, receive: trio.MemoryReceiveChannel):
        self.request_id = group.request_id
        self._engine = engine
        self._group = group
        self._receive = receive
        self._index = group.requests.index
        self._unfinished = len(group.requests.members)
        self._next: StepOutput | None = None  # read ahead: another member's, or after a final one

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        if self._next is not None:
            out, self._next = self._next, None
        else:
            try:
                out = await self._receive.receive()
            except trio.EndOfChannel:
                if self._unfinished:
                    raise EngineUnavailableError(f"The engine stopped: {self._engine.error!r}") from self._engine.error
                raise StopAsyncIteration from None
        while not out.finished:
            try:
                more = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if more.request_id != out.request_id:
                self._next = more
                break
            out = out.then(more)
        if out.finished:
            self._unfinished -= 1
        return self._index[out.request_id], out

    @property
    def abort_note(self) -> dict | None:
        """What the abort that ended this group said about itself, if it said anything."""
        return self._group.abort_note

    def stop(self, index: int, reason: FinishReason = FinishReason.STOP) -> None:
        """End one member early (a stop string matched); its final output still arrives."""
        self._engine._link.submit(Stop(self.request_id, index, reason))

    def close(self) -> None:
        self._receive.close()
        if self._unfinished:
            self._engine._link.submit(Abort(self.request_id, FinishReason.ABORT))


class AsyncEngine:
    """The engine's Trio front, and the one way into it: handlers add groups, abort them, read
    the stats and what is served (`config`, `args`, `tokenizer`, `adapters`), and the weight
    routes use its part `weights` (WeightCycle: sleep, wake-up, updates, LoRA adapters). Its
    other parts: `admission` (Admission: the waiting limit, grammar compiles, the swap's gate)
    and `live` (LiveGroups: the index of live groups that routes aborts and outputs)."""

    def __init__(self, core: EngineCore | EngineLink, max_waiting: int):
        self.core = core
        self.error: Exception | None = None  # set when the engine task died
        self.accepting = True  # False once draining or closing: new requests get 503
        self.num_steps = 0
        self.live = LiveGroups()
        self.admission = Admission(max_waiting, core.grammars)
        self.weights = WeightCycle(self)
        self._running = False  # run() has started
        self._stopped = trio.Event()
        self._cancel_scope = trio.CancelScope()
        self._stats = core.stats()
        self._link = core if isinstance(core, EngineLink) else StepThread(core)
        # Whether other fronts (processes of their own: --api-server-count) share the core.
        self.shared = isinstance(core, EngineLink) and core.fronts > 1
        self._admitting = 0  # members registered here whose admission the engine has not settled
        self._calls: dict[int, PendingCall] = {}  # by the Call's id
        self._beside_limiter = trio.CapacityLimiter(1)  # calls beside the steps of a core in this process
        self._call_ids = itertools.count()
        # the threads that check requests before they queue (never Trio's default limiter, which
        # anything else in the process may fill)
        self._check_limiter = trio.CapacityLimiter(CHECK_THREADS)

    # --- what is served (read-only) --------------------------------------------------------------

    @property
    def config(self) -> ModelConfig:
        return self.core.config

    @property
    def args(self) -> EngineArgs:
        """The engine's settings, as they run (defaults resolved)."""
        return self.core.args

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def core_apart(self) -> bool:
        """Whether the core runs in a process of its own (its operations are then all calls)."""
        return isinstance(self._link, EngineLink)

    @property
    def lora_enabled(self) -> bool:
        return self.core.loras is not None

    @property
    def adapters(self) -> Mapping[str, LoRAAdapter]:
        """The LoRA adapters requests may name, by name (empty with LoRA off)."""
        return MappingProxyType({} if self.core.loras is None else self.core.loras.adapters)

    @property
    def sleeping(self) -> bool:
        return self.weights.sleeping

    # --- what handlers call ------------------------------------------------------------------

    def check_room(self, size: int, param: str) -> None:
        """The waiting limit's verdict on a group of `size` engine requests (Admission.check_room:
        a 400 naming `param` if it could never fit, a 429 if it does not fit now). Callers check
        before they spend anything on the group; `add` checks again, since the queue may have
        filled in between."""
        self.admission.check_room(size, param, self.waiting())

    def waiting(self) -> int:
        """Engine requests waiting: queued here for admission, or in the core's waiting queue.
        Other fronts' are counted as the engine last reported them (shared), so their sum may
        pass the limit by what the fronts admit between two Rounds."""
        if self.shared:
            return self._admitting + self._stats.num_waiting
        return self.live.unfinished_members - self._stats.num_running

    async def add(self, requests: RequestGroup, param: str = "prompt") -> RequestStream:
        """Queue a group and wait until the engine admits it. Its id is the server's own
        (unique among live groups); its members' client ids, the client's names for them.

        Raises SamplingParamError (a ValueError with .param) if the engine refuses it (`param`
        names the field that made the group too large), QueueFullError when the waiting limit
        has no room for the whole group, EngineUnavailableError when dead or closing. Nothing is
        compiled or queued for a group that is refused. What the core would refuse of a member by
        itself (EngineCore.check_request) is refused first, in a worker thread, so that such a
        400 never waits for the step in flight (a long prefill's seconds). Cancelled while it
        waits, it queues nothing, or aborts what it queued.
        """
        size = len(requests.members)
        self._check_open()
        self.check_room(size, param)
        await trio.to_thread.run_sync(self._check_members, requests, limiter=self._check_limiter,
                                      abandon_on_cancel=True)
        requests.checked = True  # so the engine task does not scan the prompts again
        await self.admission.compile_grammars(requests)
        admit = await self._link.prepare(requests)
        await self.admission.wait_open()
        # The world may have changed meanwhile; from here to registering there is no checkpoint.
        self._check_open()
        self.check_room(size, param)
        send, receive = trio.open_memory_channel[StepOutput](math.inf)
        group = LiveGroup(requests, send, unfinished=size)
        self.live.register(group)
        self._link.submit(admit)
        stream = RequestStream(self, group, receive)
        self._admitting += size
        try:
            await group.admitted.wait()
        except BaseException:
            stream.close()
            raise
        finally:
            self._admitting -= size
        if group.error is not None:
            receive.close()
            raise group.error
        return stream

    def _check_members(self, requests: RequestGroup) -> None:
        """EngineCore.check_request for every member (read-only: safe beside a step)."""
        for member in requests.members:
            self.core.check_request(member.prompt_token_ids, member.params)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, note: dict | None = None) -> int:
        """Abort the live group with this server id, or else every live member a client named
        so (of a batch whose prompts have their own names, only that prompt's); returns how many
        groups it touched (0: none). Returns at once: the abort is applied before the next step,
        and each aborted member's stream ends with finish_reason `reason`. `note`: what the abort
        says about itself (RequestStream.abort_note)."""
        targets = self.live.named(request_id)
        for group, indices in targets:
            group.abort_note = note or group.abort_note
            self._link.submit(Abort(group.request_id, reason, indices))
        return len(targets)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT, note: dict | None = None) -> int:
        """Abort every live group of this front, as `abort` does one."""
        for group in self.live:
            group.abort_note = note or group.abort_note
            self._link.submit(Abort(group.request_id, reason))
        return len(self.live)

    async def abort_everywhere(self, request_id: str | None, reason: FinishReason = FinishReason.ABORT,
                               note: dict | None = None) -> int:
        """`abort(request_id)` (None: `abort_all`), and, where other fronts share the core, the
        same of theirs, between two steps; how many groups it touched in all. Their streams end
        as their own aborts would, their `abort_note` set. EngineUnavailableError if the engine
        died (this front's groups are aborted all the same)."""
        touched = [g.request_id for g in self.live] if request_id is None else [
            g.request_id for g, _ in self.live.named(request_id)]
        if request_id is None:
            self.abort_all(reason, note)
        else:
            self.abort(request_id, reason, note)
        if self.shared:
            touched += await self.call_core(ABORT_NAMED, request_id, reason, note)
        return len(set(touched))

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, between two steps; False while any request is live (the core
        says so too, for one admitted meanwhile). EngineUnavailableError if the engine died."""
        self.check_alive()
        if len(self.live):
            return False
        return await self.call_core("reset_prefix_cache")

    def stats(self) -> ServingStats:
        """The core's counters as of the last step or command, plus the front's own."""
        return ServingStats(
            **vars(self._stats),
            num_live_requests=len(self.live),
            num_steps=self.num_steps,
            alive=self.error is None,
            accepting=self.accepting,
            is_sleeping=self.sleeping,
        )

    # --- for the named parts -----------------------------------------------------------------

    def refresh_stats(self) -> None:
        """Read the core's stats now, unless a step runs (it reads them when it ends): the
        core's records change on the step's thread. (An engine in its own process sends them
        after each of its rounds.)"""
        if isinstance(self._link, StepThread) and not self._link.stepping:
            self._stats = self.core.stats()

    async def call_core(self, method: str, *args, beside: bool = False):
        """The core's `method(*args)` (one of rounds.CALLS), between two steps (or, `beside`, in a
        thread of its own while the core steps), wherever the core runs: its result, or what it
        raised; EngineUnavailableError if the engine died or stopped, before or meanwhile.
        Cancelled, it returns at once (the call is still made), except beside a core in this
        process, where it waits for its thread."""
        if self.error is not None or self._stopped.is_set():
            raise EngineUnavailableError(self._unavailable_reason())
        if beside and not self.core_apart:
            return await trio.to_thread.run_sync(getattr(self.core, method), *args, limiter=self._beside_limiter)
        call_id = next(self._call_ids)
        self._calls[call_id] = pending = PendingCall()
        self._link.submit(Call(call_id, method, args, beside))
        try:
            await pending.done.wait()
        finally:
            del self._calls[call_id]
        if isinstance(pending.reply, Exception):
            raise pending.reply
        return pending.reply

    def check_alive(self) -> None:
        """EngineUnavailableError once the engine died or began to close."""
        if self.error is not None or not self.accepting:
            raise EngineUnavailableError(self._unavailable_reason())

    async def settle(self, timeout: float, why: str) -> None:
        """Let live requests finish for up to `timeout` seconds, abort the rest, and wait until
        every group has ended (the caller keeps new ones out)."""
        with trio.move_on_after(timeout):
            await self.live.idle.wait()
        num_aborted = self.abort_all()
        if num_aborted:
            log.info("%s timeout: aborting %d requests", why, num_aborted)
        await self.live.idle.wait()

    # --- lifetime -----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The engine task. An error inside a step ends it and fails every live request; it
        does not propagate, so the server stays up to report itself unhealthy."""
        self._running = True
        task_status.started()
        try:
            with self._cancel_scope:
                await self._loop()
        except Exception as exc:
            log.exception("the engine task died")
            self._die(exc)
        finally:
            self._stopped.set()
            for call_id in list(self._calls):  # none will be answered now
                self._reply(call_id, EngineUnavailableError(self._unavailable_reason()))

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: take no new requests, let running ones finish for up to
        `timeout` seconds, then abort the rest (their streams end with finish_reason abort)."""
        self.accepting = False
        await self.settle(timeout, "drain")

    async def aclose(self) -> None:
        """Abort everything, wait until every stream got its final output, stop the task."""
        self.accepting = False
        if not self._running:
            return  # never started: nothing was admitted, nothing runs
        self.abort_all()
        if not self._stopped.is_set():
            await self.live.idle.wait()
        self._cancel_scope.cancel()
        await self._stopped.wait()

    # --- the engine task ----------------------------------------------------------------------

    async def _loop(self) -> None:
        await self._link.run(self._settle)

    def _settle(self, done: Round) -> None:
        """On the event loop, after a round: end each refused admission, let every admitted
        group's `add` return, send the outputs in the order the round made them, and hand the
        calls their replies."""
        for group_id, error in done.admissions:
            group = self.live.get(group_id)
            if error is not None:
                group.error = error
                group.send.close()
                self.live.unregister(group)
            group.admitted.set()
        for group_id, note in done.notes:  # another front's abort by name
            self.live.get(group_id).abort_note = note
        for group_id, out in done.outputs:
            self._send(self.live.get(group_id), out)
        if done.adapters is not None:  # a front loaded or unloaded one
            self.core.follow_adapters(done.adapters)
        for call_id, reply in done.replies:
            self._reply(call_id, reply)
        self.num_steps += done.stepped
        if done.stats is not None:
            self._stats = done.stats

    def _reply(self, call_id: int, reply) -> None:
        pending = self._calls.get(call_id)
        if pending is not None:  # else its caller has gone
            pending.reply = reply
            pending.done.set()

    def _send(self, group: LiveGroup, out: StepOutput) -> None:
        try:
            group.send.send_nowait(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the handler has gone; its close() queued the abort
        if out.finished and self.live.member_finished(group):
            group.send.close()
            self.live.unregister(group)

    def _die(self, exc: Exception) -> None:
        """Fail every live group and give the core's requests back their blocks: a dead engine
        takes no more steps, but the KV pool must not stay held by requests no one will end."""
        self.error = exc
        self._link.after_death()
        for group in self.live.clear():
            group.send.close()  # an admitted group's stream then raises EngineUnavailableError
            if not group.admitted.is_set():
                group.error = EngineUnavailableError(f"The engine stopped: {exc!r}")
                group.admitted.set()

    def _check_open(self) -> None:
        if self.error is not None or not self.accepting or self.sleeping:
            raise EngineUnavailableError(self._unavailable_reason())

    def _unavailable_reason(self) -> str:
        if self.error is not None:
            return f"The engine stopped: {self.error!r}"
        if self.accepting and self.sleeping:
            return "The server is sleeping: POST /wake_up to serve again."
        return "The server is shutting down."
