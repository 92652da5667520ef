"""StepThread: the engine core in the server's own process, its rounds on a worker thread.

The AsyncEngine's link to a core it holds (the other is trillm/engine/core_process.py). Commands
queue here; the engine task takes them all to the step's worker thread, where the RoundRunner
applies them between two steps and steps (trillm/engine/rounds.py), and settles each Round back
on the loop. So the loop keeps serving while the model computes and while a long prompt is
admitted; the step and the loop share the interpreter's lock, which is what the engine's own
process takes away.

Why a round at a time, each handed back before the next: the loop's work on a round (settling it,
then framing and sending every stream's tokens) runs while the thread waits, when the kernels'
threads are idle. A thread that stepped on would run that work beside a step, where it takes a core
from the kernels' pool, and would outpace a loop that falls behind, so that aborts and disconnects
land later (benchmarks/README.md, "Rounds back to back": no faster, measured).

Ownership: the Trio thread alone submits and runs; the runner runs on a worker thread, one round
at a time, on a limiter of its own (never Trio's default, which anything else may fill).
"""
from __future__ import annotations

from collections.abc import Callable

import trio

from trillm.engine.core import EngineCore
from trillm.engine.group import RequestGroup
from trillm.engine.rounds import Admit, Command, Round, RoundRunner, trips


class StepThread:
    def __init__(self, core: EngineCore):
        self.core = core
        self.commands: list[Command] = []  # submitted, for the next round
        self.stepping = False  # a round runs in the worker thread
        self._runner = RoundRunner(core)
        self._limiter = trio.CapacityLimiter(1)
        self._wake = trio.Event()

    async def prepare(self, requests: RequestGroup) -> Admit:
        """The group's Admit (the runner takes the group itself: one process)."""
        return Admit(requests)

    def submit(self, command: Command) -> None:
        """Queue a command for the next round. Never blocks."""
        self.commands.append(command)
        self._wake.set()

    async def run(self, settle: Callable[[Round], None]) -> None:
        """Round after round, each settled on the loop, while there are commands or unfinished
        requests; parked otherwise. Raises a step's error once its round is settled. Cancelled
        while a round runs, it abandons nothing: the thread is not abandonable, so it returns
        after the round."""
        while True:
            if not self.commands and not self.core.has_unfinished():
                self._wake = trio.Event()
                await self._wake.wait()
            commands, self.commands = self.commands, []
            self.stepping = True
            try:
                for trip in trips(commands):
                    done = await trio.to_thread.run_sync(self._runner.run, *trip, limiter=self._limiter)
                    settle(done)
                    if done.error is not None:
                        raise done.error
            finally:
                self.stepping = False

    def after_death(self) -> None:
        """The engine died: give its requests their blocks back (no one will end them) and drop
        what was queued."""
        self._runner.abort_all()
        self.commands.clear()
