"""Prompt logprobs: the log-probability the model gave each prompt token, gathered chunk by chunk.

The logprob of prompt token p comes from the logits of row p - 1, so a request that asks for
them computes every row from its start position on (its prefix-cache hit is capped, see
`SamplingParams.prefix_hit_limit`) and the runner keeps the step's hidden states. Each step
takes the rows that fall in the chunks it computed; the vocabulary projection runs on at most
`ROWS_PER_PROJECTION` rows at once, so a long prompt never holds a [prompt, vocab] tensor.
Values are log-softmax of the raw logits, as the sampled tokens' are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trillm.engine.sampler import TokenLogprobs, token_logprobs

ROWS_PER_PROJECTION = 256  # [256, vocab] fp32 logits at a time: 50 MB for a 49k vocabulary


@dataclass(eq=False)
class PromptLogprobs:
    """One request's prompt logprobs, filled in position order; `done` once every prompt position
    from `start` has its entry. A chunk computed again after a preemption adds nothing twice."""

    prompt_token_ids: list[int]
    start: int  # the first prompt position reported
    num_top: int  # top logprobs per position, besides the prompt token's own
    entries: list[TokenLogprobs | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start == 0:
            self.entries.append(None)  # nothing precedes the first token

    @property
    def next_position(self) -> int:
        """The first prompt position without an entry."""
        return self.start + len(self.entries)

    @property
    def done(self) -> bool:
        return self.next_position >= len(self.prompt_token_ids)

    def rows_wanted(self, first: int, count: int) -> range:
        """Of a chunk computing positions [first, first + count), the chunk rows whose logits give
        a missing entry (row r predicts position first + r + 1)."""
        assert first <= max(self.next_position - 1, 0), "a chunk skipped rows whose logits are wanted"
        lo = max(first, self.next_position - 1)
        hi = min(first + count, len(self.prompt_token_ids) - 1)
        return range(lo - first, max(hi, lo) - first)


def fill_prompt_logprobs(wanted: list[tuple[PromptLogprobs, int, range]], logits_of: Callable) -> None:
    """`wanted`: per request, its record, the offset of its chunk's first row in the step's
    hidden states, and the chunk rows it wants (`rows_wanted`); `logits_of(row indices) -> fp32
    logits` of those rows of the step's hidden states. Appends the entries, in position order."""
    rows, targets, owners = [], [], []
    for owner, offset, chunk_rows in wanted:
        position = owner.next_position
        for r in chunk_rows:
            rows.append(offset + r)
            targets.append(owner.prompt_token_ids[position])
            owners.append(owner)
            position += 1
    for lo in range(0, len(rows), ROWS_PER_PROJECTION):
        hi = lo + ROWS_PER_PROJECTION
        logprobs = torch.log_softmax(logits_of(rows[lo:hi]), dim=-1)
        target = torch.tensor(targets[lo:hi], device=logprobs.device)
        entries = token_logprobs(logprobs, target, [o.num_top for o in owners[lo:hi]], ranks=True)
        for owner, entry in zip(owners[lo:hi], entries):
            owner.entries.append(entry)
