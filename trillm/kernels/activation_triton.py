"""SiLU-and-mul and GELU(tanh)-and-mul as Triton kernels; twins of `activation.py`.

Fusing the gate's activation with the product reads [gate | up] once and writes the
result once, instead of materializing the activated gate in between.
"""
import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per program: large enough to stream, small enough for any I


_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a plain float global does not compile


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inter, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 g (1 + tanh(u)) = g sigmoid(2 u): the tanh form without a tanh instruction
        u = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        out = gate * tl.sigmoid(2.0 * u) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up]; returns silu(gate) * up, [T, I]."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up]; returns gelu_tanh(gate) * up, [T, I]."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    assert x2.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block)
    return out.view(*x.shape[:-1], inter)
