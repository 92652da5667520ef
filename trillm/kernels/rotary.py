"""Rotary position embedding applied in place on q and k, torch reference twin."""
import torch


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache: [max_pos, D] fp32,
    holding cos in its first D/2 columns and sin in the last D/2.

    neox layout rotates the two halves of each head (x[:D/2], x[D/2:]); gpt-j layout
    rotates interleaved pairs (x[0::2], x[1::2]). q and k are overwritten.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (q, k):
        xf = x.float()
        if is_neox:
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x.copy_(rotated)
