"""Small GGUF files written from tiny HF models, as llama.cpp's converter lays them out: its tensor
names, its q/k row permutation for the architectures it permutes, its metadata keys. The loader's
tests read them in place and compare with transformers on the HF model they came from."""
from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.torch import load_file
from transformers import AutoConfig

LAYER_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's norms around attention and the MLP, as llama.cpp's converter names them
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_ARCHITECTURES = {"gemma3_text": "gemma3"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str, model_type: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    names = GEMMA_LAYER_NAMES if model_type == "gemma3_text" else LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: within each head, (half, pair) becomes (pair, half)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(hf_dir: str, path: str, kind: GGMLQuantizationType = GGMLQuantizationType.F32) -> str:
    """The tiny model at `hf_dir` as a GGUF file at `path`, its 2-D weights in `kind` (quantized by
    gguf-py), its 1-D ones in F32; Gemma's norms as 1 + w, its layer types as a per-layer flag; a linear or
    yarn RoPE scaling as llama.cpp's keys.
    Returns `path`."""
    config = AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCHITECTURES.get(config.model_type, config.model_type)
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
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config.layer_types])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_bos_token_id(config.bos_token_id)
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if arch == "llama" and ".q_proj." in name:
            tensor = permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = permute(tensor, config.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1
        data = tensor.float().numpy()
        if data.ndim == 2 and kind != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name, config.model_type), quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name, config.model_type), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_foreign_gguf(path: str, arch: str = "bert") -> str:
    """A well-formed GGUF file holding token embeddings alone: of an architecture trillm does not
    serve, or ("llama") one whose header passes every check but that its layers' tensors are
    missing."""
    return _write_small_gguf(path, arch, {"token_embd.weight": np.zeros((8, 32), dtype=np.float32)})


def write_misshapen_gguf(path: str) -> str:
    """A Llama GGUF file holding every tensor its header's two layers need, but whose MLP's down
    projections are (8, 32) where the header makes them (32, 64)."""
    return _write_small_gguf(path, "llama", _small_llama_tensors(down=(8, 32)))


def write_untokenizable_gguf(path: str) -> str:
    """A Llama GGUF file whose header passes every check and whose tensors are all of their
    shapes, but whose vocabulary names a byte-pair tokenizer without its merges: only building
    the tokenizer, as a load does, finds that out."""
    tokens = [f"t{i}" for i in range(8)]
    return _write_small_gguf(path, "llama", _small_llama_tensors(down=(32, 64)),
                             lambda writer: (writer.add_tokenizer_model("gpt2"), writer.add_token_list(tokens)))


def _small_llama_tensors(down: tuple[int, int]) -> dict[str, np.ndarray]:
    """Every tensor the two layers of _write_small_gguf's header need, the down projections `down`."""
    shapes = {"attn_norm": (32,), "ffn_norm": (32,), "attn_q": (32, 32), "attn_k": (32, 32), "attn_v": (32, 32),
              "attn_output": (32, 32), "ffn_gate": (64, 32), "ffn_up": (64, 32), "ffn_down": down}
    tensors = {"token_embd.weight": np.zeros((8, 32), dtype=np.float32),
               "output_norm.weight": np.ones(32, dtype=np.float32)}
    for layer in range(2):
        tensors.update({f"blk.{layer}.{name}.weight": np.ones(shape, dtype=np.float32)
                        for name, shape in shapes.items()})
    return tensors


def _write_small_gguf(path: str, arch: str, tensors: dict[str, np.ndarray], add_metadata=lambda writer: None) -> str:
    """`tensors` in a GGUF file of `arch` whose header says: two layers, 32 wide, a 64-wide MLP, two
    heads (and what `add_metadata` adds to the writer)."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    add_metadata(writer)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
