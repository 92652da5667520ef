"""RMSNorm and the fused residual-add + RMSNorm, torch reference twins.

torch's own fused `F.rms_norm` rather than pow / mean / rsqrt / mul: one op instead of six, 60
times a step, which on CPU is most of a norm's cost at decode batch sizes.
"""
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]. Computed in fp32, returned in x's dtype."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the second is the next residual."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed
