"""What an embedding request asks: how its prompt's final hidden states become one vector.

An embedding request is a prefill-only engine request: it computes its prompt in the same steps,
batches and KV blocks as generation, samples nothing, and ends with its pooled hidden state
(`StepOutput.pooled`, fp32, raw). Normalising and truncating to `dimensions` are the caller's
(the HTTP side's), so `/pooling` can return the raw vector from the same engine output.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingType(enum.StrEnum):
    LAST = "last"  # the last prompt token's state (Qwen3-Embedding's, decoder embedders')
    MEAN = "mean"  # the mean over every prompt token
    CLS = "cls"  # the first token's state

    @property
    def prefix_hit_limit(self) -> int:
        """Prompt tokens the prefix cache may serve (-1: any): a cached block has KV but no
        hidden states, so mean and cls pooling compute every row they read."""
        return -1 if self is PoolingType.LAST else 0


@dataclass(frozen=True)
class PoolingParams:
    pooling: PoolingType = PoolingType.LAST
    n: int = 1  # one vector per input, always; a group fans out on this as on SamplingParams.n
    lora_name: str | None = None  # the LoRA adapter to run under (None: the base model)

    def __post_init__(self) -> None:
        assert self.n == 1, "a pooling request makes one vector per input"
        object.__setattr__(self, "pooling", PoolingType(self.pooling))
