"""The quantized projections of a GGUF file, under their HF names, for the kernels that run them.

The loader hands over the file's quantized blocks in the kernels' three layouts (Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 / Q4_K / Q5_K repacked exactly, other formats requantized to 8 bits), so that the CPU kernels
multiply by them instead of by fp32 copies, and then fills everything else from the fp32 HF directory it
converts the file into (trillm/model/loader.py). Only Llama-family tensor names are mapped, and
q/k rows get the reordering transformers applies (llama.cpp stores them permuted for its RoPE
layout); a repacked weight dequantizes to the fp32 tensor the directory holds, which the tests
check.

Where each tensor lies in the file is read once, by gguf-py's GGUFReader, and kept in the
converted directory (`gguf_tensors.json`): the reader parses every metadata field, the whole
vocabulary included, which took seconds of every start-up; later loads map the file and slice.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import PretrainedConfig

from trillm.kernels import quant

log = logging.getLogger(__name__)
# Formats a file may hold that are stored as they are, not quantized: their fp32 copies are exact.
_UNQUANTIZED = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})

# the formats the kernels run, repacked into their layouts (trillm/kernels/quant.py)
FORMATS = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q5_0: "q5_0",
           GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
           GGMLQuantizationType.Q5_K: "q5_k"}

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


INDEX_FILE = "gguf_tensors.json"


def tensor_index(gguf_path: str, cache_dir: str) -> list[dict]:
    """Every tensor of the file: its name, GGML type, absolute byte offset, size in bytes and the
    shape of its data as GGUFReader gives it (rows x bytes for block formats). Read from cache_dir's
    INDEX_FILE, or from the file and then written there (atomically: a reader never sees half)."""
    path = os.path.join(cache_dir, INDEX_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        pass
    index = [
        {"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset), "bytes": int(t.n_bytes),
         "shape": list(t.data.shape)}
        for t in GGUFReader(gguf_path).tensors
    ]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, path)
    return index


def quantized_weights(
    gguf_path: str, config: PretrainedConfig, cache_dir: str
) -> Iterator[tuple[str, quant.QuantizedWeight]]:
    """(HF name, weight) for every quantized projection of the file: repacked exactly when its
    format is one of FORMATS, else requantized to 8-bit blocks from gguf-py's dequantization
    (quant.requantize), which an INFO line counts. Unquantized tensors (F32, F16, BF16) are not
    listed: their fp32 copies are exact. cache_dir: the file's converted directory, which keeps
    the tensor index."""
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    requantized: dict[str, int] = {}
    for tensor in tensor_index(gguf_path, cache_dir):
        name, kind = hf_name(tensor["name"]), GGMLQuantizationType(tensor["type"])
        if name is None or kind in _UNQUANTIZED:
            continue
        blocks = np.array(data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]).reshape(tensor["shape"])
        if kind in FORMATS:
            weight = quant.from_gguf(FORMATS[kind], torch.from_numpy(blocks))
        else:
            weight = quant.requantize(torch.from_numpy(np.ascontiguousarray(dequantize(blocks, kind))))
            requantized[kind.name] = requantized.get(kind.name, 0) + 1
        if ".q_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_attention_heads))
        elif ".k_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_key_value_heads))
        yield name, weight
    if requantized:
        log.info("%s: %s projections requantized to 8-bit blocks for the integer kernels, which read %s "
                 "blocks as they are", os.path.basename(gguf_path),
                 ", ".join(f"{count} {kind}" for kind, count in sorted(requantized.items())),
                 ", ".join(k.name for k in FORMATS))


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: within each head, its stored row order
    is (pair, half) and HF's is (half, pair)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
