"""WeightCycle: the weights' life cycle while the engine serves: sleep and wake-up, an update
from disk that swaps the model between two steps, and LoRA adapters loaded and unloaded.

One sleep, wake-up or update at a time (a lock); each is all or nothing: what cannot be done is a
WeightsError (or a LoRAError) and the weights that served before still serve.

Ownership: a part of one AsyncEngine, used on the Trio thread. The core's operations are calls
(AsyncEngine.call_core), wherever the core runs: between two steps, except new weights' load,
beside them in a thread of its own (a GGUF file converts for a long time). Adapters are read on
the compile threads, here.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from trillm.engine.errors import EngineUnavailableError, WeightsError
from trillm.model.loader import ArchitectureMismatch
from trillm.model.lora import LoRAError

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


def _weights_refusal(exc: Exception) -> str:
    """Why new weights cannot serve, in words that quote nothing from the files (a client may
    name a path it cannot read itself): the whole reason goes to the log."""
    if isinstance(exc, FileNotFoundError):
        return "there is no model there (a .gguf file, or a directory with a config.json)"
    if isinstance(exc, ArchitectureMismatch):
        return f"they are of another architecture ({exc.field} differs from the serving model's)"
    return "they cannot be read as weights of the serving model's architecture"


class WeightCycle:
    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._core = engine.core
        self.sleeping = False  # requests get 503 from the moment a sleep begins until the wake-up
        self._lock = trio.Lock()

    async def sleep(self, level: int, timeout: float) -> int:
        """Sleep mode: requests get 503 from now on; running ones finish for up to `timeout`
        seconds (then they are aborted, as in a drain); then the core frees the KV cache and, at
        level 2, the weights. Returns the bytes freed. WeightsError if it cannot sleep."""
        async with self._lock:
            self._engine.check_alive()
            self.sleeping = True
            try:
                await self._engine.settle(timeout, "sleep")
                with trio.CancelScope(shield=True):  # a client that leaves does not leave it half known
                    freed = await self._engine.call_core("sleep", level)
            except ValueError as exc:
                raise WeightsError(str(exc)) from None
            finally:
                with trio.CancelScope(shield=True):
                    await self._read_sleep()
            log.info("sleeping at level %d: %d MiB freed", level, freed >> 20)
            return freed

    async def wake_up(self, tags: set[str] | None = None) -> None:
        """Bring back what sleep freed (`tags`: "weights", "kv_cache"; None: all); requests are
        served again once nothing sleeps. WeightsError for an unknown tag."""
        async with self._lock:
            self._engine.check_alive()
            with trio.CancelScope(shield=True):  # a client that leaves does not leave it half known
                try:
                    await self._engine.call_core("wake_up", tags)
                except ValueError as exc:
                    raise WeightsError(str(exc)) from None
                finally:
                    asleep = await self._read_sleep()
            if asleep:
                log.info("partly awake: %s still sleeps", ", ".join(asleep))
            else:
                log.info("awake")

    async def _read_sleep(self) -> list[str]:
        """What sleeps now, as the core says (also `sleeping`); a dead engine's, as it was."""
        try:
            asleep = await self._engine.call_core("asleep")
        except EngineUnavailableError:
            return []
        self.sleeping = bool(asleep)
        return asleep

    async def update(self, path: str, abort_running: bool = False) -> int:
        """Serve the weights at `path` from the next step on. They load into a model of their own
        while the old one serves; then admissions wait, running requests finish (or, with
        `abort_running`, are aborted), the new model takes over and the prefix cache is emptied,
        and admissions go on. Returns how many requests were aborted. WeightsError (a 400) for a
        path that cannot be loaded, another architecture or other shapes: the old weights keep
        serving, and nothing half-loaded ever does."""
        async with self._lock:
            self._engine.check_alive()
            if self.sleeping:
                raise WeightsError("The server is sleeping: wake it up before updating its weights.")
            try:
                await self._engine.call_core("stage_weights", path, beside=True)
            except EngineUnavailableError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to load is the request's bad path
                log.warning("the weights at %s cannot serve: %s", path, exc)
                raise WeightsError(f"The weights at {path!r} cannot serve: {_weights_refusal(exc)}.") from None
            with self._engine.admission.held():
                try:
                    num_aborted = self._engine.abort_all() if abort_running else 0
                    await self._engine.live.idle.wait()
                    self._engine.check_alive()
                    # Between two steps; admissions are held, so no group registers meanwhile.
                    args = await self._engine.call_core("swap_staged_weights")
                    if self._engine.core_apart:  # what it serves now, as the server reports it
                        self._core.args = args
                finally:
                    self._engine.refresh_stats()
            log.info("now serving the weights at %s (%d requests aborted)", path, num_aborted)
            return num_aborted

    async def load_lora(self, name: str, path: str, inplace: bool = False, limit: int | None = None) -> None:
        """Make the PEFT adapter at `path` servable as `name`. Its files are read and checked in a
        worker thread; then it is registered at once (admissions look it up between steps).
        LoRAError says what is wrong (a 400), or that LoRA is off. `inplace` (vLLM's load_inplace):
        an adapter already loaded under `name` gets these weights (under a new id, so the old
        weights' cached blocks are never reused), refused (400) while requests use it; an adapter
        that cannot be served leaves the old one in place. `limit`: at most this many adapters
        registered at once (a new name past it is a 400)."""
        if self._core.loras is None:
            raise LoRAError("LoRA adapters need a server started with --enable-lora.")
        self._check_lora_room(name, inplace, limit)
        weights = await trio.to_thread.run_sync(self._core.loras.read, path,
                                                limiter=self._engine.admission.compile_limiter)
        # again, with no checkpoint before registering: the read may have raced another load
        replacing = self._check_lora_room(name, inplace, limit)
        if self._engine.core_apart:  # the engine's registry decides; this copy follows it
            adapter = await self._engine.call_core("load_lora", name, path, weights, replacing)
            self._core.loras.adapters.pop(name, None)
            self._core.loras.adapters[name] = adapter
            return
        self._core.load_lora(name, path, weights, replacing)
        self._engine.refresh_stats()

    def _check_lora_room(self, name: str, inplace: bool, limit: int | None) -> bool:
        """Whether loading `name` replaces an adapter; LoRAError if the name is taken (and not
        `inplace`) or a new name would pass `limit`."""
        adapters = self._core.loras.adapters
        if name in adapters:
            if not inplace:
                raise LoRAError(f"The LoRA adapter {name!r} has already been loaded.")
            return True
        if limit is not None and len(adapters) >= limit:
            raise LoRAError(f"This server holds {len(adapters)} LoRA adapters, its limit (--max-lora-adapters); "
                            "unload one first.")
        return False

    async def unload_lora(self, name: str) -> None:
        """Forget an adapter: LoRAError 404 if unknown, 400 while live requests use it (refused,
        not waited for). Its requests' blocks left the prefix cache's reach with its id."""
        if self._engine.core_apart:
            await self._engine.call_core("unload_lora", name)
            self._core.loras.adapters.pop(name, None)
            return
        self._core.unload_lora(name)
        self._engine.refresh_stats()
