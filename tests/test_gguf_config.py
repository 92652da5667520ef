"""A GGUF file's config (gguf_model.hf_config) is made without the model type's transformers config
class, whose import costs a second of every start: it must hold every field trillm reads as that
class would hold it, and give the model code the same layers, windows, activations and RoPE
tables, for every architecture the loader serves and every RoPE scaling it reads."""
import pytest
import torch
from gguf_support import write_gguf
from transformers import AutoConfig

from trillm.model import gguf_model
from trillm.model.gguf_file import GGUFFile
from trillm.model.llama import activation_of, head_dim_of, layer_type_of, rope_cos_sin_cache, sliding_window_of
from trillm.model.loader import ARCHITECTURE_FIELDS, check_same_architecture

# every config field trillm's code reads (beside ARCHITECTURE_FIELDS), and those the type classes
# add that a reader might take for the model's
READ_FIELDS = ("hidden_activation", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "eos_token_id",
               "bos_token_id", "pad_token_id", "query_pre_attn_scalar", "sliding_window", "layer_types",
               "architectures", "final_logit_softcapping", "attn_logit_softcapping", "use_sliding_window",
               "original_max_position_embeddings")
KINDS = {"llama": ("llama", {}), "llama-linear": ("llama", {"rope_parameters": {
             "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
         "llama-yarn": ("llama", {"rope_parameters": {
             "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}}),
         "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "phi3": ("phi3", {}), "gemma3": ("gemma3_text", {})}


@pytest.fixture(params=[*KINDS, "default", "gemma3-270m"])
def gguf_path(request, tiny_model_dir, tmp_path):
    if request.param == "default":
        from trillm.model.loader import default_model_path

        return default_model_path()
    if request.param == "gemma3-270m":
        return request.getfixturevalue("gemma3_gguf")
    kind, overrides = KINDS[request.param]
    return write_gguf(tiny_model_dir(kind, **overrides), str(tmp_path / f"{request.param}.gguf"))


def test_a_gguf_files_config_holds_what_its_types_class_would(gguf_path):
    with GGUFFile(gguf_path) as file:
        made = gguf_model.hf_config(file)
        model_type, architecture, fields = gguf_model.config_fields(file)
    classed = AutoConfig.for_model(model_type, architectures=[architecture], **fields)
    assert type(made) is gguf_model.GGUFConfig and made.model_type == classed.model_type
    for name in (*ARCHITECTURE_FIELDS, *READ_FIELDS):
        assert hasattr(made, name) == hasattr(classed, name), name
        assert getattr(made, name, None) == getattr(classed, name, None), name
    check_same_architecture(classed, made)
    assert made.to_dict()["model_type"] == model_type
    assert (head_dim_of(made), activation_of(made)) == (head_dim_of(classed), activation_of(classed))
    layers = range(made.num_hidden_layers)
    assert [layer_type_of(made, i) for i in layers] == [layer_type_of(classed, i) for i in layers]
    assert [sliding_window_of(made, i) for i in layers] == [sliding_window_of(classed, i) for i in layers]
    for layer_type in {layer_type_of(made, i) for i in layers}:
        assert torch.equal(rope_cos_sin_cache(made, 64, layer_type), rope_cos_sin_cache(classed, 64, layer_type))
