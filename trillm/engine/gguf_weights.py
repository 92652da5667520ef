"""The quantized projections of a GGUF file, under their HF names, for the kernels that run them.

The loader hands over the file's Q4_1 / Q8_0 blocks as they are, so that the CPU kernels multiply
by them instead of by fp32 copies, and then fills everything else from the fp32 HF directory it
converts the file into (trillm/engine/loader.py). Only Llama-family tensor names are mapped, and
q/k rows get the reordering transformers applies (llama.cpp stores them permuted for its RoPE
layout); a dequantized result equals the fp32 tensor the directory holds, which the tests check.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from transformers import PretrainedConfig

from trillm.kernels import quant

FORMATS = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}

LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a projection's weight, or None for tensors that are not projections."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"  # the vocab projection when the embeddings are tied
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match is None or match[2] not in LAYER_TENSORS:
        return None
    return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.weight"


def quantized_weights(gguf_path: str, config: PretrainedConfig) -> Iterator[tuple[str, quant.QuantizedWeight]]:
    """(HF name, weight) for every projection stored in a format the kernels run; others (F32,
    K-quants) are not listed, and stay on their fp32 copies."""
    for tensor in GGUFReader(gguf_path).tensors:
        name = hf_name(tensor.name)
        if name is None or tensor.tensor_type not in FORMATS:
            continue
        weight = quant.from_gguf(FORMATS[tensor.tensor_type], torch.from_numpy(np.array(tensor.data)))
        if ".q_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_attention_heads))
        elif ".k_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_key_value_heads))
        yield name, weight


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: within each head, its stored row order
    is (pair, half) and HF's is (half, pair)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
