"""Pooling: an embedding request's prompt hidden states, reduced to one vector over its chunks.

The runner keeps a step's final hidden states (after the model's last norm, as transformers'
`last_hidden_state`) when a request in it pools; each chunk hands its rows here. Mean pooling
sums as chunks arrive, so a long prompt never holds all its rows. A chunk computed again after
a preemption adds nothing twice.
"""
from __future__ import annotations

import torch

from trillm.pooling_params import PoolingType


class Pooler:
    """One request's pooling; `result` (fp32 [hidden]) once its last prompt row was seen."""

    def __init__(self, pooling: PoolingType, num_prompt_tokens: int):
        self.pooling = pooling
        self.num_prompt_tokens = num_prompt_tokens
        self.next_position = 0  # mean pooling: the rows before it are in `total`
        self.total: torch.Tensor | None = None
        self.result: torch.Tensor | None = None

    def take(self, first: int, rows: torch.Tensor) -> None:
        """`rows`: the hidden states [count, hidden] of the chunk computing positions
        [first, first + count); a view into the step's tensor, copied where it is kept."""
        end = first + rows.shape[0]
        if self.pooling is PoolingType.CLS:
            if first == 0:
                self.result = rows[0].float().clone()
        elif self.pooling is PoolingType.LAST:
            if end == self.num_prompt_tokens:
                self.result = rows[-1].float().clone()
        elif end > self.next_position:
            assert first <= self.next_position, "mean pooling takes no prefix-cache hit"
            part = rows[self.next_position - first:].float().sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.next_position = end
            if end == self.num_prompt_tokens:
                self.result = self.total / self.num_prompt_tokens
