"""What a GGUF file's metadata says of its model: the transformers config, the tokenizer with its
chat template, the end-of-generation tokens. Nothing here reads a weight.

The config is built from llama.cpp's keys (`{arch}.block_count`, `{arch}.attention.head_count`,
...), the fields transformers' own GGUF loader fills, for the architectures the model code runs;
any other architecture is refused here, before a weight is read. The tokenizer is transformers'
conversion of the file's vocabulary (its GGUF tokenizer builder, fed by trillm/model/
gguf_tokenizer.py), the same one a conversion to an HF directory would save.
"""
from __future__ import annotations

import logging

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from trillm.model import gguf_tokenizer
from trillm.model.gguf_file import GGUFFile
from trillm.model.unservable import UnservableModel

log = logging.getLogger(__name__)

# GGUF architecture -> transformers model_type and class (llama.cpp writes Mistral's models as "llama")
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM"),
                 "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# architectures whose q and k rows llama.cpp's converter permutes for its RoPE layout
PERMUTED_QK = frozenset({"llama"})
# Gemma 3 (text): llama.cpp's converter stores its norms as 1 + w, the multipliers the model uses
GEMMA_ARCHITECTURES = frozenset({"gemma3"})
# what llama.cpp takes for a Gemma 3 file without the keys: every sixth layer global, the
# sliding layers' RoPE base
GEMMA_SLIDING_PATTERN = 6
GEMMA_SLIDING_ROPE_BASE = 10000.0
# the chat template of a file that has none, llama.cpp's fallback too
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


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
    head_dim = _head_dim(file)
    if file.field("rope.dimension_count", head_dim) != head_dim:
        raise UnservableModel(f"The model turns {file.field('rope.dimension_count')} of its heads' {head_dim} "
                              "dimensions (partial rotary embeddings), which trillm does not run yet.")


def _head_dim(file: GGUFFile) -> int:
    return file.field("attention.key_length", file.field("embedding_length") // file.field("attention.head_count"))


def max_positions(file: GGUFFile) -> int:
    """The positions the model was made for (llama.cpp's context length; 2048 where unsaid)."""
    return file.field("context_length", 2048)


class GGUFConfig(PretrainedConfig):
    """A GGUF file's model config: the fields trillm reads, each as the model type's own
    transformers config class would hold it (config_fields). That class is not imported: its
    module pulls in transformers' model-loading stack (torch.distributed, sympy), about a second
    of every start. `model_type` is the instance's (a class has one alone)."""

    def to_dict(self) -> dict:
        return {**super().to_dict(), "model_type": self.model_type}


# What each model type's transformers config class sets where a GGUF file says nothing, among the
# fields trillm reads or compares (loader.ARCHITECTURE_FIELDS); tests/test_gguf_config.py holds
# them to the classes
TYPE_DEFAULTS = {
    "llama": dict(hidden_act="silu", mlp_bias=False),
    "qwen2": dict(hidden_act="silu", sliding_window=None, use_sliding_window=False),
    "qwen3": dict(hidden_act="silu", attention_bias=False, sliding_window=None, use_sliding_window=False),
    "phi3": dict(hidden_act="silu", original_max_position_embeddings=4096),
    "gemma3_text": dict(attention_bias=False, final_logit_softcapping=None, attn_logit_softcapping=None),
}


def hf_config(file: GGUFFile) -> GGUFConfig:
    """The config of the file's model (check_servable first), as its type's transformers config
    class would make it from config_fields."""
    model_type, architecture, fields = config_fields(file)
    fields = {**TYPE_DEFAULTS[model_type], **fields}
    if model_type in ("qwen2", "qwen3"):  # their classes name every layer's type
        fields.setdefault("layer_types", ["full_attention"] * fields["num_hidden_layers"])
    if model_type == "phi3":  # its class states the whole rotation
        fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": 1.0}
    return GGUFConfig(model_type=model_type, architectures=[architecture], **fields)


def config_fields(file: GGUFFile) -> tuple[str, str, dict]:
    """The file's model type, its transformers class's name and the config fields llama.cpp's keys
    give (check_servable first): what `AutoConfig.for_model(model_type, architectures=[name],
    **fields)` takes, as transformers' own GGUF loader fills them."""
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
        head_dim=_head_dim(file),
        max_position_embeddings=max_positions(file),
        rms_norm_eps=float(file.field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if file.architecture == "llama":  # Qwen2's q/k/v biases are its type's; a Llama file's are a flag
        fields["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if file.architecture in GEMMA_ARCHITECTURES:
        fields.update(_gemma_fields(file, rope))
    if file.architecture == "phi3":  # Phi-3 mini attends within a window, as transformers runs it
        fields["sliding_window"] = file.field("attention.sliding_window")
    model_type, architecture = ARCHITECTURES[file.architecture]
    return model_type, architecture, fields


def _gemma_fields(file: GGUFFile, rope: dict) -> dict:
    """Gemma 3's own config fields, as llama.cpp reads the file: sliding layers (every
    GEMMA_SLIDING_PATTERN-th global unless the file says) with their own RoPE base, the file's
    base and scaling on the global ones, GeGLU, and the query scale 1 / sqrt(head_dim) (27B,
    the 62-layer size: 1 / sqrt(hidden / heads))."""
    layers = file.field("block_count")
    pattern = file.field("attention.sliding_window_pattern", GEMMA_SLIDING_PATTERN)
    sliding = pattern if isinstance(pattern, list) else [bool((i + 1) % pattern) for i in range(layers)]
    heads, hidden = file.field("attention.head_count"), file.field("embedding_length")
    return dict(
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        sliding_window=file.field("attention.sliding_window"),
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA_SLIDING_ROPE_BASE}},
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hidden // heads if layers == 62 else _head_dim(file),
    )


def eos_token_ids(file: GGUFFile) -> list[int]:
    """The tokens that end a generation: the file's EOS, then its end-of-turn and end-of-message
    tokens where it names others (llama.cpp stops at every one of them)."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = file.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    return ids


def tokenizer(file: GGUFFile) -> PreTrainedTokenizerBase | None:
    """The file's tokenizer and chat template, None when it holds no vocabulary. Read from the
    file itself (trillm/model/gguf_tokenizer.py: nothing looks for a hub)."""
    if "tokenizer.ggml.model" not in file.metadata:
        return None
    try:
        tokenizer = gguf_tokenizer.build(file)
    except (KeyError, ValueError, TypeError) as exc:
        raise UnservableModel(f"The model file's tokenizer cannot be built ({type(exc).__name__}).") from None
    if tokenizer.chat_template is None:
        log.warning("the model file has no chat template: chat requests are rendered as ChatML, as llama.cpp's "
                    "server does")
        # a chat prompt is encoded without special tokens (its template writes them): a model
        # that wants a BOS gets it from the template, as llama.cpp adds it
        adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        tokenizer.chat_template = ("{{ bos_token }}" if adds_bos else "") + CHATML
    return tokenizer
