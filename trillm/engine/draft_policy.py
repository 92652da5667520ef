"""DraftPolicy: whether a decode step drafts, decided by what drafting has measured to be worth
at the batch's size on this device.

A verification's extra rows cost little where a step is bound by reading the weights (one
stream on a CPU; most batches on a GPU, below its arithmetic roof) and cost every request time
where the step is bound by arithmetic (a large batch on a CPU). Where one turns into the other
depends on the device, the model and how many drafts the workload keeps, so no constant fits
them all: the policy measures. Decode steps are grouped by their batch's power of two; in each
group it keeps the output tokens per second of the steps that verified drafts and of those that
did not (exponentially weighted means), and drafts while drafting's rate is the higher. Until
drafts have been verified at a batch size it drafts there (a step whose requests had none to
propose measures the plain choice); then the slower choice is tried again every PROBE_EVERY
steps of its group, so that a change (the workload starts repeating itself, contexts grow) is
seen and followed.

`disable_by_batch_size`, when the config gives it (vLLM's key), is the user's fixed rule
instead: drafts only while at most that many requests run (0: always).

Ownership: the core's, on the thread that steps it; not thread-safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16  # a group's steps between two tries of the choice that measured slower
WEIGHT = 0.25  # a new step's weight in its choice's mean rate


@dataclass
class Rates:
    """One batch group's measured output rates, tokens per second, by whether the step drafted
    (None: not measured yet), and its steps since the slower choice was last tried."""

    drafting: float | None = None
    plain: float | None = None
    since_probe: int = 0

    def add(self, drafted: bool, rate: float) -> None:
        old = self.drafting if drafted else self.plain
        new = rate if old is None else old + WEIGHT * (rate - old)
        if drafted:
            self.drafting = new
        else:
            self.plain = new


@dataclass
class DraftPolicy:
    cap: int | None = None  # disable_by_batch_size when given; None: measured
    groups: dict[int, Rates] = field(default_factory=dict)  # batch group -> its rates

    @staticmethod
    def group(num_running: int) -> int:
        """A batch's group: its power of two (1; 2-3; 4-7; 8-15; ...)."""
        return max(num_running, 1).bit_length()

    def drafts(self, num_running: int) -> bool:
        """Whether the step about to run with `num_running` requests drafts. Counts the step
        toward its group's next try of the slower choice."""
        if self.cap is not None:
            return self.cap == 0 or num_running <= self.cap
        rates = self.groups.setdefault(self.group(num_running), Rates())
        if rates.drafting is None or rates.plain is None:
            return rates.drafting is None
        faster = rates.drafting >= rates.plain
        rates.since_probe += 1
        if rates.since_probe >= PROBE_EVERY:
            rates.since_probe = 0
            return not faster
        return faster

    def measured(self, num_running: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt in it) ran with `num_running` requests, verified drafts or
        not, and made `num_tokens` output tokens in `seconds`."""
        if self.cap is None and seconds > 0:
            self.groups.setdefault(self.group(num_running), Rates()).add(drafted, num_tokens / seconds)
