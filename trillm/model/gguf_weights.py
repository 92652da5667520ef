"""A GGUF file's tensors under their HF names: the projections as the kernels' quantized blocks,
the rest dense, and the token embeddings as rows read from the file when a lookup names them.

Nothing goes through an fp32 copy of the model: each tensor is read from the file on its own
(trillm/model/gguf_file.py), repacked or converted, and dropped before the next, so loading holds
at most the model's kernel form and one tensor's worth beside it; a large tensor is repacked a
slice of rows at a time. Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks are
repacked exactly into the kernels' layouts (trillm/kernels/quant.py) where the kernel reads that
layout; other formats are requantized to 8-bit blocks from gguf-py's dequantization, which an
INFO line counts. The integer kernel regroups K-quant tensors from the file's bytes itself
(`quantized_weights(..., in_place=True)` hands them on unread). Where llama.cpp's converter
permuted q and k rows for its RoPE layout (PERMUTED_QK), they get the reordering transformers
applies; a repacked weight dequantizes to the tensor transformers loads from the file, which the
tests check.
"""
from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import PretrainedConfig

from trillm.heap import trim_c_heap
from trillm.kernels import quant
from trillm.model.gguf_file import GGUFFile, TensorInfo, to_float
from trillm.model.gguf_model import ARCHITECTURES, GEMMA_ARCHITECTURES, PERMUTED_QK
from trillm.model.llama import GEMMA, QK_NORM, QKV_BIAS, head_dim_of
from trillm.model.unservable import UnservableModel

log = logging.getLogger(__name__)
# Formats stored as they are, not quantized: their dense tensors are exact.
UNQUANTIZED = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})

# the formats the kernels run, repacked into their layouts (trillm/kernels/quant.py)
FORMATS = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q5_0: "q5_0",
           GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
           GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k"}

# a GGUF_BLOCKS format and a tensor's raw blocks -> its weight in the kernels' layout
Repack = Callable[[str, torch.Tensor], quant.QuantizedWeight]

LAYER_TENSORS = {
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's, fused as ours
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
PROJECTIONS = frozenset(v for k, v in LAYER_TENSORS.items() if not k.endswith("norm")) | {"mlp.gate_up_proj"}
# Gemma 3 norms the attention's output and the MLP's input and output: its "ffn_norm" is the
# MLP's input norm, where a Llama file's is the one after attention
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's "ffn_up" holds gate and up fused, as our gate_up_proj
PHI3_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_up": "mlp.gate_up_proj"}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                  "output_norm.weight": "model.norm.weight"}
VOCABULARY = frozenset({"output.weight", "token_embd.weight"})
# derived from the config, not loaded (llama.cpp's frequency factors of Llama 3.1's RoPE)
IGNORED = frozenset({"rope_freqs.weight"})
ROWS_AT_ONCE = 4096  # a large tensor is repacked this many rows at a time
# file bytes, or tensors, converted between two trims of the C heap: each trim costs a few
# milliseconds and the pages it hands back fault in again, so it waits for a few tensors' worth;
# small tensors leave more garbage than their size (a 270M model's 145 leave twice theirs)
TRIM_EVERY = 128 << 20
TRIM_EVERY_TENSORS = 16


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The HF name of a tensor the model loads, None for one it derives (IGNORED).
    UnservableModel for a tensor the model has no place for."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name in IGNORED:
        return None
    layer_tensors = (GEMMA_LAYER_TENSORS if architecture in GEMMA_ARCHITECTURES else
                     PHI3_LAYER_TENSORS if architecture == "phi3" else LAYER_TENSORS)
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match[2] not in layer_tensors:
        raise UnservableModel(f"The model file holds a tensor trillm has no place for: {gguf_name!r}.")
    return f"model.layers.{match[1]}.{layer_tensors[match[2]]}.{match[3]}"


def missing_tensors(file: GGUFFile) -> list[str]:
    """The tensors the model of the file's header needs (check_servable first) that the file does
    not hold, by llama.cpp's names, layer by layer: read from the header, before any weight, so
    that a file short of a layer is refused in a line rather than found out half loaded. q, k and
    v may come as three or fused (attn_qkv); Phi-3's gate and up come fused in its ffn_up."""
    model_type = ARCHITECTURES[file.architecture][0]
    needed = ["attn_norm", "ffn_norm", "attn_output", "ffn_up", "ffn_down"]
    needed += [] if file.architecture == "phi3" else ["ffn_gate"]
    needed += ["attn_q_norm", "attn_k_norm"] if model_type in QK_NORM else []
    needed += ["post_attention_norm", "post_ffw_norm"] if model_type in GEMMA else []
    missing = [name for name in ("output_norm.weight",) if name not in file.tensors]
    for layer in range(file.field("block_count")):
        names = [f"blk.{layer}.{name}.weight" for name in needed]
        if f"blk.{layer}.attn_qkv.weight" not in file.tensors:
            names += [f"blk.{layer}.{name}.weight" for name in ("attn_q", "attn_k", "attn_v")]
            names += [f"blk.{layer}.{name}.bias" for name in ("attn_q", "attn_k", "attn_v") if model_type in QKV_BIAS]
        missing += [name for name in names if name not in file.tensors]
    return missing


def is_projection(name: str) -> bool:
    """Whether HF tensor `name` is a projection's weight (the vocabulary's included)."""
    return name in ("lm_head.weight", "model.embed_tokens.weight") or (
        name.endswith(".weight") and name.rpartition(".")[0].partition(".layers.")[2].partition(".")[2] in PROJECTIONS)


def quantized_weights(file: GGUFFile, config: PretrainedConfig, kernel=None, in_place: bool = False
                      ) -> Iterator[tuple[str, quant.QuantizedWeight | quant.RowSlices | quant.FileBlocks]]:
    """(HF name, weight) for every quantized projection of the file, the token embeddings where
    they are tied (the vocabulary projection then; untied, they are a lookup table): repacked
    exactly when its format is one of FORMATS and its layout one of the kernel's, else
    requantized to 8-bit blocks. Converted ROWS_AT_ONCE rows at a time; the vocabulary projection
    goes to a kernel as RowSlices, which it regroups slice by slice, so that the largest tensor is
    never held twice. `kernel`: the linear class that will take them (its `layouts`,
    and its twins of quant.from_gguf and quant.requantize, which load faster); None: every
    layout, by the torch twins. `in_place`: a tensor in one of the kernel's `file_formats`
    comes unread, as FileBlocks, for the kernel to regroup from the file itself (repacking is
    then its `weight()`). Unquantized tensors (F32, F16, BF16) are left to `dense_weights`."""
    layouts = frozenset(quant.LAYOUT_BYTES) if kernel is None else kernel.layouts
    file_formats = kernel.file_formats if in_place else frozenset()
    repack = repack_of(kernel)
    requantize = quant.requantize if kernel is None else kernel.requantize
    requantized: dict[str, int] = {}
    unfreed, untrimmed = 0, 0  # bytes and tensors converted since the C heap was last trimmed
    # the vocabulary projection first: where it is converted whole (no kernel takes its slices),
    # its transient second copy then sits beside nothing else of the model
    vocabulary_first = sorted(file.tensors.values(), key=lambda info: info.name not in VOCABULARY)
    for info in vocabulary_first:
        name = hf_name(info.name, file.architecture)
        if name is None or info.kind in UNQUANTIZED or not is_projection(name):
            continue
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        if info.kind in FORMATS and quant.LAYOUT_OF[FORMATS[info.kind]] in layouts:
            layout = quant.LAYOUT_OF[FORMATS[info.kind]]
            slice_of = functools.partial(_repacked, file, info, repack)
        else:
            layout = "q8_0"
            slice_of = functools.partial(_requantized, file, info, repack, requantize)
            requantized[info.kind.name] = requantized.get(info.kind.name, 0) + 1
        weight = quant.RowSlices(layout, info.rows, info.shape[1], slice_of, ROWS_AT_ONCE)
        order = _unpermute_order(file, config, name)
        if FORMATS.get(info.kind) in file_formats:
            weight = quant.FileBlocks(FORMATS[info.kind], info.rows, info.shape[1],
                                      functools.partial(file.mapped, info.name), order,
                                      functools.partial(_whole, weight, order), ROWS_AT_ONCE)
        elif kernel is None or info.name not in VOCABULARY:
            weight = _whole(weight, order)
        yield name, weight
        del weight
        unfreed, untrimmed = unfreed + info.nbytes, untrimmed + 1
        if unfreed >= TRIM_EVERY or untrimmed >= TRIM_EVERY_TENSORS:
            trim_c_heap()  # what these conversions freed, before the next ones pile on it
            unfreed, untrimmed = 0, 0
    if requantized:
        log.info("%s projections requantized to 8-bit blocks for the integer kernels, which read %s blocks as "
                 "they are", ", ".join(f"{count} {kind}" for kind, count in sorted(requantized.items())),
                 ", ".join(k.name for k, f in FORMATS.items() if quant.LAYOUT_OF[f] in layouts))


def repack_of(kernel) -> Repack:
    """What repacks a file's blocks for `kernel` (a linear class, as quantized_weights takes it):
    its compiled twin of quant.from_gguf, or the torch one where there is no kernel."""
    return quant.from_gguf if kernel is None else kernel.from_gguf


def _whole(weight: quant.RowSlices, order: torch.Tensor | None) -> quant.QuantizedWeight:
    return weight.whole() if order is None else weight.whole().rows(order)


def hf_shape(name: str, config: PretrainedConfig) -> tuple[int, ...]:
    """The shape of HF tensor `name` (hf_name's) in the model of `config`, as a checkpoint of it
    holds the tensor: what the model's own parameters make of the config, without building it."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    rows = {"embed_tokens": config.vocab_size, "lm_head": config.vocab_size, "q_proj": q, "k_proj": kv,
            "v_proj": kv, "qkv_proj": q + 2 * kv, "o_proj": hidden, "gate_proj": inter, "up_proj": inter,
            "gate_up_proj": 2 * inter, "down_proj": hidden, "q_norm": head_dim, "k_norm": head_dim}
    module, kind = name.split(".")[-2:]
    width = rows.get(module, hidden)  # the rest are norms over the hidden state
    if kind == "bias" or module.endswith("norm"):
        return (width,)
    return width, q if module == "o_proj" else inter if module == "down_proj" else hidden


def misshapen_tensors(file: GGUFFile, config: PretrainedConfig) -> list[str]:
    """The file's tensors whose shape is not the one the model of its header (`config`) holds
    them in, each as "name (its shape; the model's)": read from the header, so that such a file
    is refused in a line rather than found out half loaded."""
    misshapen = []
    for info in file.tensors.values():
        name = hf_name(info.name, file.architecture)
        if name is not None and info.shape != (expected := hf_shape(name, config)):
            misshapen.append(f"{info.name} ({', '.join(map(str, info.shape))}; the model's "
                             f"{', '.join(map(str, expected))})")
    return misshapen


def dense_weights(file: GGUFFile, config: PretrainedConfig, skip: Callable[[str], bool], kernel=None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file but those `skip` names, which are never
    read: dequantized one at a time (through `kernel`'s repack, as quantized_weights takes it), q
    and k rows in transformers' order."""
    repack = repack_of(kernel)
    for info in file.tensors.values():
        name = hf_name(info.name, file.architecture)
        if name is None or skip(name):
            continue
        tensor = dequantized(file.blocks(info.name), info.kind, repack).reshape(info.shape)
        order = _unpermute_order(file, config, name)
        yield name, tensor if order is None else tensor[order]


def dequantized(blocks: np.ndarray, kind: GGMLQuantizationType, repack: Repack = quant.from_gguf) -> torch.Tensor:
    """[rows, bytes of a row] of `kind` -> [rows, values of a row] fp32, bit for bit as gguf-py
    dequantizes. The formats the kernels run are repacked (by `repack`: quant.from_gguf, or a
    kernel's compiled twin of it) and dequantized by the torch twin, which tests/test_kernels.py
    holds to gguf-py's bits: gguf-py's numpy passes take up to a few times as long on a large
    tensor, which the exact path's load of a large vocabulary's table waits on."""
    if kind in FORMATS:
        return quant.dequantize(repack(FORMATS[kind], torch.from_numpy(blocks)))
    return torch.from_numpy(to_float(blocks, kind))


class EmbeddingRows:
    """The token embeddings as the file holds them, in its block format: a lookup reads just the
    rows it names from the file (GGUFFile.row_reader: none of the table becomes resident) and
    dequantizes them as gguf-py does, so exactly the dense table's rows."""

    def __init__(self, file: GGUFFile, dtype: torch.dtype):
        info = file.tensors["token_embd.weight"]
        self.blocks, self.kind, self.dtype = file.row_reader(info.name), info.kind, dtype
        self.num_embeddings, self.embedding_dim = info.shape

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[input_ids.cpu().numpy()]
        return dequantized(rows, self.kind).to(self.dtype)


def _repacked(file: GGUFFile, info: TensorInfo, repack: Repack, rows: slice) -> quant.QuantizedWeight:
    return repack(FORMATS[info.kind], torch.from_numpy(file.blocks(info.name, rows)))


def _requantized(file: GGUFFile, info: TensorInfo, repack: Repack, requantize, rows: slice) -> quant.QuantizedWeight:
    return requantize(dequantized(file.blocks(info.name, rows), info.kind, repack))


def _unpermute_order(file: GGUFFile, config: PretrainedConfig, name: str) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's q/k permutation for tensor `name`, None for other
    tensors and architectures: within each head, its stored row order is (pair, half) and HF's is
    (half, pair)."""
    if file.architecture not in PERMUTED_QK:
        return None
    if ".self_attn.q_proj." in name:
        heads = config.num_attention_heads
    elif ".self_attn.k_proj." in name:
        heads = config.num_key_value_heads
    else:
        return None
    rows = heads * head_dim_of(config)
    return torch.arange(rows).reshape(heads, -1, 2).transpose(1, 2).reshape(rows)
