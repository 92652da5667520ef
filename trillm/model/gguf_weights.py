"""The quantized projections of a GGUF file, under their HF names, for the kernels that run them.

The loader hands over the file's Q4_1 / Q8_0 blocks as they are, so that the CPU kernels multiply
by them instead of by fp32 copies, and then fills everything else from the fp32 HF directory it
converts the file into (trillm/model/loader.py). Only Llama-family tensor names are mapped, and
q/k rows get the reordering transformers applies (llama.cpp stores them permuted for its RoPE
layout); a dequantized result equals the fp32 tensor the directory holds, which the tests check.

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
from transformers import PretrainedConfig

from trillm.kernels import quant

log = logging.getLogger(__name__)
# Formats a file may hold that are stored as they are, not quantized: their fp32 copies are exact.
_UNQUANTIZED = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})

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
    """(HF name, weight) for every projection stored in a format the kernels run; others (F32,
    K-quants) are not listed, and stay on their fp32 copies. cache_dir: the file's converted
    directory, which keeps the tensor index."""
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    others: dict[str, int] = {}  # quantized formats the kernels do not read: projections on fp32 copies
    for tensor in tensor_index(gguf_path, cache_dir):
        name, kind = hf_name(tensor["name"]), GGMLQuantizationType(tensor["type"])
        if name is not None and kind not in FORMATS and kind not in _UNQUANTIZED:
            others[kind.name] = others.get(kind.name, 0) + 1
        if name is None or kind not in FORMATS:
            continue
        blocks = np.array(data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]).reshape(tensor["shape"])
        weight = quant.from_gguf(FORMATS[kind], torch.from_numpy(blocks))
        if ".q_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_attention_heads))
        elif ".k_proj." in name:
            weight = weight.rows(_unpermute(weight.out_features, config.num_key_value_heads))
        yield name, weight
    if others:
        log.warning("%s: %s projections run on dequantized fp32 copies, ~4-7x the memory traffic of "
                    "their blocks (the kernels read %s blocks directly)", os.path.basename(gguf_path),
                    ", ".join(f"{count} {kind}" for kind, count in sorted(others.items())),
                    " and ".join(k.name for k in FORMATS))


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: within each head, its stored row order
    is (pair, half) and HF's is (half, pair)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
