"""Admission: what a request group passes before the engine task takes it.

In order: the waiting limit (`check_room`: a 400 for a group larger than the limit on its own, a
429 while the queue has no room for it), its grammars compiled in worker threads (so admitting it
between two steps finds them cached), and the gate a weight update closes while it swaps the model
(`held`), so that the new weights serve a group that arrives meanwhile.

Ownership: used on the Trio thread only; compiles run in worker threads on limiters of their own,
because on Trio's default limiter (shared by every to_thread call in the process) slow compiles
could take every token and starve the engine's steps. A compile tries the quick lane first and
goes on in the slow lane, one at a time, when it needs longer (structured_output.Grammars).
"""
from __future__ import annotations

from contextlib import contextmanager

import trio

from trillm.engine.errors import QueueFullError
from trillm.engine.group import RequestGroup
from trillm.engine.structured_output import COMPILE_SLOTS, Grammars, SlowCompile
from trillm.sampling_params import SamplingParamError, SamplingParams


class Admission:
    def __init__(self, max_waiting: int, grammars: Grammars):
        assert max_waiting >= 0
        self.max_waiting = max_waiting
        self._grammars = grammars
        self.compile_limiter = trio.CapacityLimiter(COMPILE_SLOTS)  # LoRA adapters are read on it too
        self._slow_compile_limiter = trio.CapacityLimiter(1)
        self._open = trio.Event()
        self._open.set()

    def check_room(self, size: int, param: str, num_waiting: int) -> None:
        """Refuse a group of `size` engine requests that the waiting limit cannot take, with
        `num_waiting` members waiting now: a SamplingParamError naming `param` (a 400: it could
        never be admitted, so retrying is pointless) when it is larger than the limit on its own,
        QueueFullError (a 429) when it does not fit now."""
        if size > self.max_waiting:
            raise SamplingParamError(
                param,
                f"This request makes {size} engine requests (prompts x n); this server lets at most "
                f"{self.max_waiting} wait at once (--max-waiting).",
            )
        if num_waiting + size > self.max_waiting:
            raise QueueFullError(
                f"The server has {num_waiting} requests waiting and a limit of {self.max_waiting}; retry later."
            )

    async def compile_grammars(self, requests: RequestGroup) -> None:
        """Compile the group's structured-output specs (a ValueError for one that cannot be
        compiled or passes the compile timeout). Cancelled (the client left), it returns at once
        and leaves its thread to finish that compile, within the same timeout."""
        specs = {m.params.structured_output for m in requests.members if isinstance(m.params, SamplingParams)}
        for spec in specs - {None}:
            try:
                await trio.to_thread.run_sync(self._grammars.compile, spec, True, limiter=self.compile_limiter,
                                              abandon_on_cancel=True)
            except SlowCompile:
                await trio.to_thread.run_sync(self._grammars.compile, spec, limiter=self._slow_compile_limiter,
                                              abandon_on_cancel=True)

    async def wait_open(self) -> None:
        """Return once no weight update holds admissions."""
        await self._open.wait()

    @contextmanager
    def held(self):
        """Hold admissions for the block (a weight update swapping the model); they go on after it."""
        self._open = trio.Event()
        try:
            yield
        finally:
            self._open.set()
