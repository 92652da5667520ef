"""Small GGUF files written from tiny HF models, as llama.cpp's converter lays them out: its tensor
names, its q/k row permutation for the architectures it permutes, its metadata keys. The loader's
tests read them in place and compare with transformers on the HF model they came from."""
from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from transformers import AutoConfig

LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: within each head, (half, pair) becomes (pair, half)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(hf_dir: str, path: str, kind: GGMLQuantizationType = GGMLQuantizationType.F32) -> str:
    """The tiny model at `hf_dir` as a GGUF file at `path`, its 2-D weights in `kind` (quantized by
    gguf-py), its 1-D ones in F32. Returns `path`."""
    config = AutoConfig.from_pretrained(hf_dir)
    arch = config.model_type
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_bos_token_id(config.bos_token_id)
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if arch == "llama" and ".q_proj." in name:
            tensor = permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = permute(tensor, config.num_key_value_heads)
        data = tensor.float().numpy()
        if data.ndim == 2 and kind != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_foreign_gguf(path: str, arch: str = "bert") -> str:
    """A well-formed GGUF file holding token embeddings alone: of an architecture trillm does not
    serve, or ("llama") one whose header passes the checks and whose load finds every layer
    missing."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
