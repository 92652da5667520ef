"""The gated MLP's activations, torch reference twins: SiLU-and-mul (Llama, Qwen, Mistral) and
GELU(tanh)-and-mul (Gemma's GeGLU)."""
import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up]; returns silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up]; returns gelu(gate) * up, [T, I], GELU in its tanh
    approximation (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
