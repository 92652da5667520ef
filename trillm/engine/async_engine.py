"""AsyncEngine: the Trio front of EngineCore.

One Trio task (`run`, started in the app's nursery) owns the core. It applies
queued admissions and aborts between two steps and runs `EngineCore.step()` in a
worker thread, so the event loop keeps serving while the model computes. Handlers
never touch the core: they queue commands and read their outputs from a memory
channel. That single owner is what makes an abort clean: it is one command,
applied between two steps, and the request's blocks are free before the next one.

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

import logging
import math
from dataclasses import dataclass, field

import trio

from trillm.engine.core import EngineCore, StepOutput
from trillm.engine.group import RequestGroup
from trillm.model.loader import ArchitectureMismatch
from trillm.model.lora import LoRAError
from trillm.engine.stats import ServingStats
from trillm.engine.structured_output import COMPILE_SLOTS
from trillm.sampling_params import SamplingParamError, SamplingParams
from trillm.sched_ext import FinishReason

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot take or finish requests: it died, the server is shutting down, or it sleeps."""


class WeightsError(ValueError):
    """A sleep, wake-up or weight update that cannot be done (a 400): the message says why, and
    the weights that served before still serve."""


def _weights_refusal(exc: Exception) -> str:
    """Why new weights cannot serve, in words that quote nothing from the files (a client may
    name a path it cannot read itself): the whole reason goes to the log."""
    if isinstance(exc, FileNotFoundError):
        return "there is no model there (a .gguf file, or a directory with a config.json)"
    if isinstance(exc, ArchitectureMismatch):
        return f"they are of another architecture ({exc.field} differs from the serving model's)"
    return "they cannot be read as weights of the serving model's architecture"


@dataclass(eq=False)
class _Group:
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


class RequestStream:
    """A group's outputs, as `(member index, StepOutput)` pairs, until every member has finished.

    Closing it (always do, in `finally`) aborts whatever of the group still runs;
    closing twice is harmless.
    """

    def __init__(self, engine: AsyncEngine, group: _Group, receive: trio.MemoryReceiveChannel):
        self.request_id = group.request_id
        self._engine = engine
        self._group = group
        self._receive = receive
        self._index = group.requests.index
        self._unfinished = len(group.requests.members)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        try:
            out = await self._receive.receive()
        except trio.EndOfChannel:
            if self._unfinished:
                raise EngineUnavailableError(f"The engine stopped: {self._engine.error!r}") from self._engine.error
            raise StopAsyncIteration from None
        if out.finished:
            self._unfinished -= 1
        return self._index[out.request_id], out

    @property
    def abort_note(self) -> dict | None:
        """What the abort that ended this group said about itself, if it said anything."""
        return self._group.abort_note

    def stop(self, index: int, reason: FinishReason = FinishReason.STOP) -> None:
        """End one member early (a stop string matched); its final output still arrives."""
        self._engine._enqueue(self._engine._finish_member, self._group, index, reason)

    def close(self) -> None:
        self._receive.close()
        if self._unfinished:
            self._engine._enqueue(self._engine._abort_group, self._group, FinishReason.ABORT)


class AsyncEngine:
    def __init__(self, core: EngineCore, max_waiting: int):
        assert max_waiting >= 0
        self.core = core
        self.max_waiting = max_waiting
        self.error: Exception | None = None  # set when the engine task died
        self.accepting = True  # False once draining or closing: new requests get 503
        self.num_steps = 0
        self._groups: dict[str, _Group] = {}  # server id -> group, from add() until its last final output
        self._by_client_id: dict[str, list[_Group]] = {}  # client id -> its live groups, oldest first
        self._owner: dict[str, _Group] = {}  # engine id -> group, for every member of a live group
        self._commands: list[tuple] = []
        # Members of live groups without their final output: queued for admission, deferred
        # (see the module docstring), waiting or running in the core.
        self._unfinished_members = 0
        self._stepping = False  # a step is running in a worker thread
        self._running = False  # run() has started
        self._wake = trio.Event()
        self._idle = trio.Event()  # set while no group is live
        self._idle.set()
        self._stopped = trio.Event()
        self._cancel_scope = trio.CancelScope()
        self._stats = core.stats()
        # Threads of their own: on Trio's default limiter (shared by every to_thread call in the
        # process), slow grammar compiles could take every token and starve the engine's steps.
        self._step_limiter = trio.CapacityLimiter(1)
        self._compile_limiter = trio.CapacityLimiter(COMPILE_SLOTS)
        # New weights load on a thread of their own (a GGUF file converts for tens of seconds);
        # LoRA adapters, small, are read on the compile threads.
        self._load_limiter = trio.CapacityLimiter(1)
        self.sleeping = False  # requests get 503 from the moment a sleep begins until the wake-up
        self._weights_lock = trio.Lock()  # one sleep, wake-up or weight update at a time
        self._admissions_open = trio.Event()  # cleared while a weight update swaps the model
        self._admissions_open.set()

    # --- what handlers call ------------------------------------------------------------------

    def check_room(self, size: int, param: str) -> None:
        """Refuse a group of `size` engine requests that the waiting limit cannot take: a
        SamplingParamError naming `param` (a 400: it could never be admitted, so retrying is
        pointless) when it is larger than the limit on its own, QueueFullError (a 429) when it
        does not fit now. Callers check before they spend anything on the group; `add` checks
        again, since the queue may have filled in between."""
        if size > self.max_waiting:
            raise SamplingParamError(
                param,
                f"This request makes {size} engine requests (prompts x n); this server lets at most "
                f"{self.max_waiting} wait at once (--max-waiting).",
            )
        waiting = self._unfinished_members - self._stats.num_running
        if waiting + size > self.max_waiting:
            raise QueueFullError(
                f"The server has {waiting} requests waiting and a limit of {self.max_waiting}; retry later."
            )

    async def add(self, requests: RequestGroup, param: str = "prompt") -> RequestStream:
        """Queue a group and wait until the engine admits it. Its id is the server's own
        (unique among live groups); its members' client ids, the client's names for them.

        Raises SamplingParamError (a ValueError with .param) if the engine refuses it (`param`
        names the field that made the group too large), QueueFullError when the waiting limit
        has no room for the whole group, EngineUnavailableError when dead or closing. Nothing is
        compiled or queued for a group that is refused.
        """
        size = len(requests.members)
        self._check_open(requests.request_id)
        self.check_room(size, param)
        # Grammars compile in worker threads, so admission between two steps finds them cached.
        specs = {m.params.structured_output for m in requests.members if isinstance(m.params, SamplingParams)}
        # A compile past the engine's timeout is stopped and refused; a cancelled wait here (the
        # client left) leaves its thread to finish that compile, within the same timeout.
        for spec in specs - {None}:
            await trio.to_thread.run_sync(self.core.grammars.compile, spec, limiter=self._compile_limiter,
                                          abandon_on_cancel=True)
        # A weight update swapping the model holds admissions: the new weights serve this group.
        await self._admissions_open.wait()
        # The world may have changed meanwhile; from here to registering there is no checkpoint.
        self._check_open(requests.request_id)
        self.check_room(size, param)
        send, receive = trio.open_memory_channel[StepOutput](math.inf)
        group = _Group(requests, send, unfinished=size)
        self._groups[requests.request_id] = group
        for member in requests.members:
            self._owner[member.request_id] = group
        for client_id in group.client_ids:
            self._by_client_id.setdefault(client_id, []).append(group)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._unfinished_members += size
        self._enqueue(self._admit, group)
        stream = RequestStream(self, group, receive)
        try:
            await group.admitted.wait()
        except BaseException:
            stream.close()
            raise
        if group.error is not None:
            receive.close()
            raise group.error
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, note: dict | None = None) -> int:
        """Abort the live group with this server id, or else every live member a client named
        so (of a batch whose prompts have their own names, only that prompt's); returns how many
        groups it touched (0: none). Returns at once: the abort is applied before the next step,
        and each aborted member's stream ends with finish_reason `reason`. `note`: what the abort
        says about itself (RequestStream.abort_note)."""
        group = self._groups.get(request_id)
        if group is not None:
            targets = [(group, None)]
        else:
            targets = [(g, g.requests.named(request_id)) for g in self._by_client_id.get(request_id, ())]
        for group, indices in targets:
            group.abort_note = note or group.abort_note
            self._enqueue(self._abort_group, group, reason, indices)
        return len(targets)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT, note: dict | None = None) -> int:
        for group in self._groups.values():
            group.abort_note = note or group.abort_note
            self._enqueue(self._abort_group, group, reason)
        return len(self._groups)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while any request is live.

        With no live group and no step in flight the engine task is parked (or about to
        be) on this same thread, so calling the core here cannot race a step."""
        if self._groups or self._stepping:
            return False
        done = self.core.reset_prefix_cache()
        self._stats = self.core.stats()
        return done

    async def load_lora(self, name: str, path: str, inplace: bool = False, limit: int | None = None) -> None:
        """Make the PEFT adapter at `path` servable as `name`. Its files are read and checked in a
        worker thread; then it is registered at once (admissions look it up between steps).
        LoRAError says what is wrong (a 400), or that LoRA is off. `inplace` (vLLM's load_inplace):
        an adapter already loaded under `name` gets these weights (under a new id, so the old
        weights' cached blocks are never reused), refused (400) while requests use it; an adapter
        that cannot be served leaves the old one in place. `limit`: at most this many adapters
        registered at once (a new name past it is a 400)."""
        if self.core.loras is None:
            raise LoRAError("LoRA adapters need a server started with --enable-lora.")
        self._check_lora_room(name, inplace, limit)
        weights = await trio.to_thread.run_sync(self.core.loras.read, path, limiter=self._compile_limiter)
        # again, with no checkpoint before registering: the read may have raced another load
        replacing = self._check_lora_room(name, inplace, limit)
        if replacing:
            self.core.unload_lora(name)
        self.core.load_lora(name, path, weights)
        self._refresh_stats()

    def _check_lora_room(self, name: str, inplace: bool, limit: int | None) -> bool:
        """Whether loading `name` replaces an adapter; LoRAError if the name is taken (and not
        `inplace`) or a new name would pass `limit`."""
        adapters = self.core.loras.adapters
        if name in adapters:
            if not inplace:
                raise LoRAError(f"The LoRA adapter {name!r} has already been loaded.")
            return True
        if limit is not None and len(adapters) >= limit:
            raise LoRAError(f"This server holds {len(adapters)} LoRA adapters, its limit (--max-lora-adapters); "
                            "unload one first.")
        return False

    def unload_lora(self, name: str) -> None:
        """Forget an adapter: LoRAError 404 if unknown, 400 while live requests use it (refused,
        not waited for). Its requests' blocks left the prefix cache's reach with its id."""
        self.core.unload_lora(name)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        """Read the core's stats now, unless a step runs (it reads them when it ends): the
        core's records change on the step's thread."""
        if not self._stepping:
            self._stats = self.core.stats()

    def stats(self) -> ServingStats:
        """The core's counters as of the last step or command, plus the front's own."""
        return ServingStats(
            **vars(self._stats),
            num_live_requests=len(self._groups),
            num_steps=self.num_steps,
            alive=self.error is None,
            accepting=self.accepting,
            is_sleeping=self.sleeping,
        )

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

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: take no new requests, let running ones finish for up to
        `timeout` seconds, then abort the rest (their streams end with finish_reason abort)."""
        self.accepting = False
        await self._settle(timeout, "drain")

    async def _settle(self, timeout: float, why: str) -> None:
        """Let live requests finish for up to `timeout` seconds, abort the rest, and wait until
        every group has ended (the caller keeps new ones out)."""
        with trio.move_on_after(timeout):
            await self._idle.wait()
        num_aborted = self.abort_all()
        if num_aborted:
            log.info("%s timeout: aborting %d requests", why, num_aborted)
        await self._idle.wait()

    # --- the weights' life cycle ------------------------------------------------------------

    async def sleep(self, level: int, timeout: float) -> int:
        """Sleep mode: requests get 503 from now on; running ones finish for up to `timeout`
        seconds (then they are aborted, as in a drain); then the core frees the KV cache and, at
        level 2, the weights. Returns the bytes freed. WeightsError if it cannot sleep."""
        async with self._weights_lock:
            self._check_alive()
            self.sleeping = True
            try:
                await self._settle(timeout, "sleep")
                freed = await trio.to_thread.run_sync(self.core.sleep, level, limiter=self._step_limiter)
            except ValueError as exc:
                raise WeightsError(str(exc)) from None
            finally:
                self.sleeping = self.core.is_sleeping
                self._refresh_stats()
            log.info("sleeping at level %d: %d MiB freed", level, freed >> 20)
            return freed

    async def wake_up(self, tags: set[str] | None = None) -> None:
        """Bring back what sleep freed (`tags`: "weights", "kv_cache"; None: all); requests are
        served again once nothing sleeps. WeightsError for an unknown tag."""
        async with self._weights_lock:
            self._check_alive()
            try:
                await trio.to_thread.run_sync(self.core.wake_up, tags, limiter=self._step_limiter)
            except ValueError as exc:
                raise WeightsError(str(exc)) from None
            finally:
                self.sleeping = self.core.is_sleeping
                self._refresh_stats()
            if self.sleeping:
                log.info("partly awake: %s still sleeps", ", ".join(sorted(self.core.runner.asleep)))
            else:
                log.info("awake")

    async def update_weights(self, path: str, abort_running: bool = False) -> int:
        """Serve the weights at `path` from the next step on. They load into a model of their own
        while the old one serves; then admissions wait, running requests finish (or, with
        `abort_running`, are aborted), the new model takes over and the prefix cache is emptied,
        and admissions go on. Returns how many requests were aborted. WeightsError (a 400) for a
        path that cannot be loaded, another architecture or other shapes: the old weights keep
        serving, and nothing half-loaded ever does."""
        async with self._weights_lock:
            self._check_alive()
            if self.sleeping:
                raise WeightsError("The server is sleeping: wake it up before updating its weights.")
            try:
                model = await trio.to_thread.run_sync(self.core.load_weights, path, limiter=self._load_limiter)
            except Exception as exc:  # noqa: BLE001 - any failure to load is the request's bad path
                log.warning("the weights at %s cannot serve: %s", path, exc)
                raise WeightsError(f"The weights at {path!r} cannot serve: {_weights_refusal(exc)}.") from None
            self._admissions_open = trio.Event()
            try:
                num_aborted = self.abort_all() if abort_running else 0
                await self._idle.wait()
                self._check_alive()
                # On this thread, with no checkpoint since idle: no group can register meanwhile.
                self.core.swap_weights(model, path)
            finally:
                self._admissions_open.set()
                self._refresh_stats()
            log.info("now serving the weights at %s (%d requests aborted)", path, num_aborted)
            return num_aborted

    def _check_alive(self) -> None:
        if self.error is not None or not self.accepting:
            raise EngineUnavailableError(self._unavailable_reason())

    async def aclose(self) -> None:
        """Abort everything, wait until every stream got its final output, stop the task."""
        self.accepting = False
        if not self._running:
            return  # never started: nothing was admitted, nothing runs
        self.abort_all()
        if not self._stopped.is_set():
            await self._idle.wait()
        self._cancel_scope.cancel()
        await self._stopped.wait()

    # --- the engine task ----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._commands and not self.core.has_unfinished():
                self._wake = trio.Event()
                await self._wake.wait()
            commands, self._commands = self._commands, []
            for fn, *args in commands:
                fn(*args)
            self._stats = self.core.stats()
            if self.core.has_unfinished():
                self._stepping = True
                try:
                    outputs = await trio.to_thread.run_sync(self.core.step, limiter=self._step_limiter)
                finally:
                    self._stepping = False
                self.num_steps += 1
                for out in outputs:
                    self._deliver(out)
                self._stats = self.core.stats()

    def _enqueue(self, fn, *args) -> None:
        self._commands.append((fn, *args))
        self._wake.set()

    def _admit(self, group: _Group) -> None:
        try:
            group.requests.admit(self.core)
        except Exception as exc:  # noqa: BLE001 - one request's refusal (or our bug in admitting it) is not the engine's death
            if not isinstance(exc, ValueError):
                log.exception("request %s: admission failed", group.request_id)
            group.error = exc
            group.send.close()
            self._unregister(group)
        group.admitted.set()

    def _deliver(self, out: StepOutput) -> None:
        group = self._owner[out.request_id]
        group.requests.on_output(self.core, out)
        self._send(group, out)

    def _send(self, group: _Group, out: StepOutput) -> None:
        try:
            group.send.send_nowait(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the handler has gone; its close() queued the abort
        if out.finished:
            group.unfinished -= 1
            self._unfinished_members -= 1
            if group.unfinished == 0:
                group.send.close()
                self._unregister(group)

    def _finish_member(self, group: _Group, index: int, reason: FinishReason) -> None:
        if self._groups.get(group.request_id) is group:
            out = group.requests.stop(self.core, index, reason)
            if out is not None:
                self._send(group, out)

    def _abort_group(self, group: _Group, reason: FinishReason, indices: list[int] | None = None) -> None:
        if self._groups.get(group.request_id) is not group:
            return  # already ended
        for out in group.requests.abort(self.core, reason, indices):
            self._send(group, out)

    def _unregister(self, group: _Group) -> None:
        assert self._groups.get(group.request_id) is group
        del self._groups[group.request_id]
        for member in group.requests.members:
            del self._owner[member.request_id]
        for client_id in group.client_ids:
            named = self._by_client_id[client_id]
            named.remove(group)
            if not named:
                del self._by_client_id[client_id]
        self._unfinished_members -= group.unfinished  # a refused group's members, never finished
        if not self._groups:
            self._idle.set()

    def _die(self, exc: Exception) -> None:
        """Fail every live group and give the core's requests back their blocks: a dead engine
        takes no more steps, but the KV pool must not stay held by requests no one will end."""
        self.error = exc
        for request_id in self._owner:
            self.core.abort_request(request_id)
        for group in self._groups.values():
            group.error = group.error or EngineUnavailableError(f"The engine stopped: {exc!r}")
            group.send.close()
            group.admitted.set()
        self._groups.clear()
        self._by_client_id.clear()
        self._owner.clear()
        self._unfinished_members = 0
        self._commands.clear()
        self._idle.set()

    def _check_open(self, request_id: str) -> None:
        if self.error is not None or not self.accepting or self.sleeping:
            raise EngineUnavailableError(self._unavailable_reason())
        assert request_id not in self._groups, "the server's request ids are unique"

    def _unavailable_reason(self) -> str:
        if self.error is not None:
            return f"The engine stopped: {self.error!r}"
        if self.accepting and self.sleeping:
            return "The server is sleeping: POST /wake_up to serve again."
        return "The server is shutting down."
