"""RMSNorm and the fused residual-add + RMSNorm as Triton kernels; twins of `norm.py`.

One program normalizes one row: a hidden size of a few thousand fits in one block, so the
row is read once, reduced in registers and written once (the op is purely memory-bound).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride,
    hidden, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, summed, mask=mask)
        # The twin normalizes the sum as stored (rounded to the activation dtype).
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    """Flattens leading dims to rows; returns (normed, summed or None)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty_like(x2)
    if residual is not None:
        assert residual.shape == x.shape
        r2 = residual.reshape(-1, hidden)
        assert r2.stride(-1) == 1, "rows must be contiguous"
        res_out = torch.empty_like(x2)
    else:
        r2 = res_out = x2  # unused: ADD_RESIDUAL is off
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            ADD_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]. Computed in fp32, returned in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the second is the next residual.

    One pass instead of three: the sum is formed, stored and normalized from registers.
    """
    return _launch(x, residual, weight, eps)
