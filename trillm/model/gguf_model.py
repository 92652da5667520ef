"""What a GGUF file's metadata says of its model: the transformers config, the tokenizer with its
chat template, the end-of-generation tokens. Nothing here reads a weight.

The config is built from llama.cpp's keys (`{arch}.block_count`, `{arch}.attention.head_count`,
...), the fields transformers' own GGUF loader fills, for the architectures the model code runs;
any other architecture is refused here, before a weight is read. The tokenizer is transformers'
conversion of the file's vocabulary (its GGUF tokenizer builder), the same one a conversion to an
HF directory would save, built in a fraction of a second.
"""
from __future__ import annotations

import os

from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trillm.model.gguf_file import GGUFFile, UnservableModel

# GGUF architecture -> transformers model_type and class (llama.cpp writes Mistral's models as "llama")
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM")}
# architectures whose q and k rows llama.cpp's converter permutes for its RoPE layout
PERMUTED_QK = frozenset({"llama"})


def check_servable(file: GGUFFile) -> None:
    """UnservableModel, in one line, when the file's architecture or shape is not one the model
    code runs."""
    if file.architecture not in ARCHITECTURES:
        raise UnservableModel(f"The model file's architecture is {file.architecture!r}; trillm serves GGUF files "
                              f"of {', '.join(ARCHITECTURES)}.")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if not isinstance(file.field(key), int):
            raise UnservableModel(f"The model file's metadata lacks {file.architecture}.{key}.")
    if "token_embd.weight" not in file.tensors:
        raise UnservableModel("The model file holds no token embeddings (token_embd.weight).")


def hf_config(file: GGUFFile) -> PretrainedConfig:
    """The transformers config of the file's model (check_servable first)."""
    check_servable(file)
    heads = file.field("attention.head_count")
    hidden = file.field("embedding_length")
    vocab = file.field("vocab_size") or file.metadata.get("tokenizer.ggml.tokens") \
        or file.tensors["token_embd.weight"].shape[0]
    rope = {"rope_type": "default", "rope_theta": float(file.field("rope.freq_base", 10000.0))}
    scaling = file.field("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(file.field("rope.scaling.factor", 1.0)))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = file.field("rope.scaling.original_context_length")
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=file.field("feed_forward_length"),
        num_hidden_layers=file.field("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=file.field("attention.head_count_kv", heads),
        head_dim=file.field("attention.key_length", hidden // heads),
        max_position_embeddings=file.field("context_length", 2048),
        rms_norm_eps=float(file.field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if file.architecture == "llama":  # Qwen2's q/k/v biases are its type's; a Llama file's are a flag
        fields["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    model_type, architecture = ARCHITECTURES[file.architecture]
    return AutoConfig.for_model(model_type, architectures=[architecture], **fields)


def eos_token_ids(file: GGUFFile) -> list[int]:
    """The tokens that end a generation: the file's EOS, then its end-of-turn and end-of-message
    tokens where it names others (llama.cpp stops at every one of them)."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = file.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    return ids


def tokenizer(path: str, file: GGUFFile) -> PreTrainedTokenizerBase | None:
    """The file's tokenizer and chat template, None when it holds no vocabulary. Read from the
    file itself (local_files_only: nothing looks for a hub)."""
    if "tokenizer.ggml.model" not in file.metadata:
        return None
    folder, name = os.path.split(os.path.abspath(path))
    try:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (KeyError, ValueError, TypeError) as exc:
        raise UnservableModel(f"The model file's tokenizer cannot be built ({type(exc).__name__}).") from None
