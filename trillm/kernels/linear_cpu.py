"""Linear layers on CPU through oneDNN, with weights packed once into its blocked layout.

Why: at decode batch sizes (a few rows), MKL's sgemm on a plain [out, in] weight runs well below
the rate the same weights stream at once packed (the measurements are in the commit that added
this module and in benchmarks/), and prefill-sized inputs run no slower. The torch twin is F.linear on the plain weight.
"""
from __future__ import annotations

import torch

# oneDNN picks the blocking for this many rows; any row count runs on the packed weight.
BATCH_HINT = 32


def is_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> an opaque oneDNN tensor that only `linear` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for x [..., in] with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
