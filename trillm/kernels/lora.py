"""The grouped LoRA multiply, torch reference twin: each row of a step adds its own adapter's
low-rank update to a projection's output.

An adapter of rank r on a projection W is y = x W^T + s B A x (PEFT's A [r, in], B [out, r],
s = lora_alpha / r). Rows of one step may use different adapters (or none), so the adapters
active in the step sit in slots of stacked tensors and each row names its slot. The scaling is
folded into B when an adapter enters a slot, B is kept transposed ([K, out]: the expand then
runs along the outputs), and a fused projection (q|k|v, gate|up) stacks its parts' A rows and
puts their B blocks on the diagonal, so one call covers every part.
"""
import torch


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             out_offsets: list[int] | torch.Tensor | None = None) -> None:
    """y [T, out] += (a[slots[t]] @ x[t]) @ b[slots[t]] for every row t whose slot is >= 0, in
    place. x [T, in]; a [S, K, in]; b [S, K, out]; slots [T] int64 (-1: the base model alone).
    `out_offsets` (a fused projection's parts: where each one's outputs start, then out) says
    that b is block-diagonal over the parts (part p's outputs read only its rows p K / parts on);
    a kernel may skip the zero blocks, the result is the same."""
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        y.index_add_(0, rows, (x[rows].to(a.dtype) @ a[slot].T @ b[slot]).to(y.dtype))
