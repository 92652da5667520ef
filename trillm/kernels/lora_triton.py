"""The grouped LoRA multiply as Triton kernels; twin of `lora.py`.

Two passes, as punica's shrink and expand: h = a[slot] x (one program per row, K small enough
to hold whole), then y += h b[slot] (one program per row and block of outputs; b is [K, out]). A row whose
slot is negative loads and stores nothing. Shapes size the grids; no value is read on the host,
so the launch is the same whatever the slots hold.
"""
import torch
import triton
import triton.language as tl

_BLOCK_IN = 128  # input columns per iteration of the shrink
_BLOCK_OUT = 128  # outputs per expand program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, n_in, K, x_stride, BLOCK_K: tl.constexpr, BLOCK_IN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * K * n_in
    for start in range(0, n_in, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        col_mask = (cols < n_in) & ((cols * 0 + slot) >= 0)  # a tensor mask: a scalar one does not broadcast
        x = tl.load(x_ptr + row * x_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + ks[:, None] * n_in + cols[None, :], mask=(ks[:, None] < K) & col_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row * BLOCK_K + ks, acc)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, n_out, K, y_stride, BLOCK_K: tl.constexpr, BLOCK_OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    ks = tl.arange(0, BLOCK_K)
    out_mask = (outs < n_out) & ((outs * 0 + slot) >= 0)
    h = tl.load(h_ptr + row * BLOCK_K + ks)
    b = tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * K * n_out + ks[None, :] * n_out + outs[:, None],
                mask=out_mask[:, None] & (ks[None, :] < K), other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    y = tl.load(y_ptr + row * y_stride + outs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + outs, (y + delta).to(y_ptr.dtype.element_ty), mask=out_mask)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             out_offsets: list[int] | torch.Tensor | None = None) -> None:
    """As lora.lora_add: y [T, out] += (a[slots[t]] @ x[t]) @ b[slots[t]] where slots[t] >= 0
    (b's zero blocks, which `out_offsets` marks, are multiplied like the rest)."""
    T, n_in = x.shape
    _, K, _ = a.shape
    n_out = y.shape[1]
    assert a.is_contiguous() and b.is_contiguous() and x.stride(1) == 1 and y.stride(1) == 1
    assert b.shape[1:] == (K, n_out) and a.shape[2] == n_in and slots.shape == (T,)
    if T == 0:
        return
    block_k = triton.next_power_of_2(K)
    h = torch.empty(T, block_k, dtype=torch.float32, device=x.device)
    _shrink_kernel[(T,)](x, a, slots, h, n_in, K, x.stride(0), BLOCK_K=block_k,
                         BLOCK_IN=min(_BLOCK_IN, triton.next_power_of_2(n_in)))
    block_out = min(_BLOCK_OUT, triton.next_power_of_2(n_out))
    _expand_kernel[(T, triton.cdiv(n_out, block_out))](h, b, slots, y, n_out, K, y.stride(0), BLOCK_K=block_k,
                                                       BLOCK_OUT=block_out)
