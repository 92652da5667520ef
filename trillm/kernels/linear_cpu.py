"""Linear layers on CPU through oneDNN, with weights packed once into its blocked layout.

Why: at decode batch sizes (a few rows), MKL's sgemm on a plain [out, in] weight runs well below
the rate the same weights stream at once packed (the measurements are in the commit that added
this module and in benchmarks/), and prefill-sized inputs run no slower. The torch twin is F.linear on the plain weight.

oneDNN builds a kernel for every row count it is given and keeps it, about half a MiB each: a
server sees every row count up to its token budget, and its memory grew by hundreds of MiB with
them. `linear` therefore runs a few row counts only: a count is padded up to one of `run_rows`'s
(an eighth more rows at most), and inputs longer than MAX_RUN_ROWS go in pieces of that many.
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


# Longer inputs run in pieces this long, which run at the whole input's rate.
MAX_RUN_ROWS = 2048


def run_rows(rows: int) -> int:
    """The row count `rows` rows run as: itself up to 16, then the next of eight counts an octave
    (18, 20, ..., 32, 36, ..., 2048), an eighth more rows at most: 72 counts in all."""
    step = 1 << max(0, (rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for x [rows, in] with W packed by `pack`, in pieces of at most MAX_RUN_ROWS
    rows, each padded to `run_rows`'s count."""
    assert x.dim() == 2, x.shape
    rows = x.shape[0]
    if rows > MAX_RUN_ROWS:
        return torch.cat([linear(x[start : start + MAX_RUN_ROWS], packed_weight, bias)
                          for start in range(0, rows, MAX_RUN_ROWS)])
    padding = run_rows(rows) - rows
    if padding:
        x = torch.nn.functional.pad(x, (0, 0, 0, padding))
    y = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return y[:rows] if padding else y
