"""What attention needs to know about one step's batch (the kernels that use it: trillm/kernels/family.py).

The batch is flat: the new tokens of every scheduled request, back to back, no padding. Request b
owns rows query_start_loc[b]:query_start_loc[b+1]; its context after this step is seq_lens[b]
tokens, all of them in the paged KV cache once this step's keys and values are written to their
slots. The metadata is built once per step and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each request's blocks
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: row offsets of each request's new tokens
    max_seq_len: int
    max_query_len: int
    # What a kernel family derives from the fields above, once per step, for every layer to reuse
    # (the torch family's attention plan). Fresh with each step's metadata, so never stale.
    per_step: dict = field(default_factory=dict, repr=False, compare=False)
