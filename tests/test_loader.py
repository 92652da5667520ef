"""Model resolution (default model, GGUF cache, HF directories) and weight loading."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from trillm.config import EngineArgs
from trillm.model.llama import Linear, rope_cos_sin_cache
from trillm.model.loader import cache_root, convert_gguf, gguf_cache_dir, load_model, resolve_model


def test_default_model_is_converted_once_into_the_cache(default_model_dir):
    assert os.path.dirname(default_model_dir) == cache_root()
    assert os.path.basename(default_model_dir).startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(default_model_dir, name)), name
    config = json.load(open(os.path.join(default_model_dir, "config.json")))
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert not [n for n in os.listdir(cache_root()) if n.startswith(".converting-")]

    weights = os.stat(os.path.join(default_model_dir, "model.safetensors"))
    assert resolve_model(None) == default_model_dir
    again = os.stat(os.path.join(default_model_dir, "model.safetensors"))
    assert (again.st_ino, again.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)  # not rewritten


def test_default_model_loads_from_the_cache(default_model_dir):
    model, config, tokenizer, model_dir = load_model(EngineArgs(quantized_weights=False))
    assert model_dir == default_model_dir
    assert config.hf_config.model_type == "llama" and config.hf_config.tie_word_embeddings
    assert (config.name, config.max_model_len, config.dtype) == ("SmolLM2-135M-Instruct", 8192, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor
    assert config.eos_token_ids == (2,) and tokenizer.eos_token_id == 2
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_gguf_cache_dir_follows_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TRILLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    first = gguf_cache_dir(str(gguf))
    assert os.path.dirname(first) == str(tmp_path / "cache") and os.path.basename(first).startswith("m-")
    assert gguf_cache_dir(str(gguf)) == first
    os.utime(gguf, ns=(0, 10**9))
    touched = gguf_cache_dir(str(gguf))
    gguf.write_bytes(b"x" * 11)
    os.utime(gguf, ns=(0, 10**9))
    assert len({first, touched, gguf_cache_dir(str(gguf))}) == 3


def test_a_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRILLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file")
    with pytest.raises(Exception):
        resolve_model(str(gguf))
    assert not os.path.exists(gguf_cache_dir(str(gguf)))
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".converting-")]


def test_a_finished_conversion_is_reused_without_reading_the_gguf(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("TRILLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not a gguf file")
    shutil.copytree(tiny_model_dir("llama"), gguf_cache_dir(str(gguf)))
    assert convert_gguf(str(gguf)) == gguf_cache_dir(str(gguf))
    assert resolve_model(str(gguf)) == gguf_cache_dir(str(gguf))


def test_resolve_model_takes_hf_dirs_and_never_a_hub_name(tiny_model_dir, tmp_path):
    assert resolve_model(tiny_model_dir("llama")) == tiny_model_dir("llama")
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path), str(tmp_path / "missing.gguf")):
        with pytest.raises(FileNotFoundError):
            resolve_model(name)


def test_fused_weights_hold_the_hf_projections(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    model = load_model(EngineArgs(model=model_dir)).model
    layer = model.model.layers[1]
    prefix = "model.layers.1."
    for param, parts in [
        (layer.self_attn.qkv_proj.weight, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (layer.self_attn.qkv_proj.bias, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (layer.mlp.gate_up_proj.weight, ["mlp.gate_proj", "mlp.up_proj"]),
    ]:
        kind = "bias" if param.dim() == 1 else "weight"
        assert torch.equal(param, torch.cat([hf[f"{prefix}{p}.{kind}"] for p in parts]))
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"])


@pytest.mark.parametrize("change", ["drop", "extra", "reshape"])
def test_incomplete_or_foreign_checkpoints_are_refused(tiny_model_dir, tmp_path, change):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    if change == "drop":
        del weights[name]
    elif change == "extra":
        weights["model.layers.2.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"].clone()
    else:
        weights[name] = weights[name][:-1]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj|lacks|layers.2"):
        load_model(EngineArgs(model=str(model_dir)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_applies_to_weights_but_not_to_the_rope_cache(tiny_model_dir, dtype):
    model_dir = tiny_model_dir("llama")
    model, config = load_model(EngineArgs(model=model_dir, dtype=dtype))[:2]
    assert config.dtype == getattr(torch, dtype)
    config = config.hf_config
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert torch.get_default_dtype() == torch.float32
    cache = model.model.cos_sin_cache
    assert cache.dtype == torch.float32
    assert torch.equal(cache, rope_cos_sin_cache(config, config.max_position_embeddings))
    with pytest.raises(ValueError, match="dtype"):
        load_model(EngineArgs(model=model_dir, dtype="float64"))


def test_eos_token_ids_come_from_the_generation_config(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(EngineArgs(model=str(model_dir)))
    assert loaded.config.eos_token_ids == (2, 7) and loaded.config.eos_token_id == 2 and loaded.tokenizer is None


def test_gguf_projections_dequantize_to_the_converted_weights(default_model_dir):
    """Every Q4_1 / Q8_0 projection the kernels take from the file, under its HF name and with
    q/k rows reordered, is bit for bit the fp32 tensor transformers converted it to."""
    from safetensors import safe_open

    from trillm.model.gguf_weights import quantized_weights
    from trillm.model.loader import default_model_path
    from trillm.kernels import quant

    config = AutoConfig.from_pretrained(default_model_dir)
    converted = safe_open(os.path.join(default_model_dir, "model.safetensors"), framework="pt")
    formats = {}
    for name, weight in quantized_weights(default_model_path(), config, default_model_dir):
        assert torch.equal(quant.dequantize(weight), converted.get_tensor(name)), name
        formats[weight.format] = formats.get(weight.format, 0) + 1
    assert formats == {"q4_1": 7 * config.num_hidden_layers, "q8_0": 1}  # the tied embeddings are Q8_0


def test_default_model_runs_its_projections_on_the_gguf_blocks():
    model = load_model(EngineArgs()).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 + 1 and all(m.quantized is not None and m.weight is None for m in linears)
    assert model.model.embed_tokens.weight is not None  # the lookup keeps its fp32 table
    dense = load_model(EngineArgs(quantized_weights=False)).model
    assert all(m.quantized is None for m in dense.modules() if isinstance(m, Linear))


def test_gguf_tensor_index_is_read_once_and_kept(tmp_path):
    """The first load reads where each tensor lies with GGUFReader and writes it to the cache
    directory; a later load takes it from there, and slices the same bytes GGUFReader gives."""
    import numpy as np
    from gguf import GGUFReader

    from trillm.model.gguf_weights import INDEX_FILE, tensor_index
    from trillm.model.loader import default_model_path

    reader = GGUFReader(default_model_path())
    index = tensor_index(default_model_path(), str(tmp_path))
    assert (tmp_path / INDEX_FILE).exists() and [e["name"] for e in index] == [t.name for t in reader.tensors]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index[:3]))  # a kept index is what later loads read
    assert tensor_index(default_model_path(), str(tmp_path)) == index[:3]
    data = np.memmap(default_model_path(), dtype=np.uint8, mode="r")
    for entry, tensor in zip(index, reader.tensors):
        got = np.asarray(data[entry["offset"] : entry["offset"] + entry["bytes"]]).view(tensor.data.dtype)
        assert np.array_equal(got.reshape(entry["shape"]), tensor.data), entry["name"]


def test_the_pooling_type_comes_from_a_sentence_transformers_config(tmp_path):
    from trillm.model.loader import sentence_transformers_pooling
    from trillm.pooling_params import PoolingType

    assert sentence_transformers_pooling(str(tmp_path)) is None  # no modules.json
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (tmp_path / "1_Pooling").mkdir()
    for flag, expected in (("pooling_mode_mean_tokens", PoolingType.MEAN), ("pooling_mode_cls_token", PoolingType.CLS),
                           ("pooling_mode_lasttoken", PoolingType.LAST), ("pooling_mode_max_tokens", None)):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, flag: True}))
        assert sentence_transformers_pooling(str(tmp_path)) == expected


def test_the_start_log_names_the_kernels_and_every_fallback(caplog, monkeypatch, tmp_path):
    """The log says which kernel family, dtypes and instruction set a server runs, and warns when
    it falls back to the torch twins because the compiled kernels cannot run."""
    import logging

    from trillm.kernels import family, quant_cpu

    with caplog.at_level(logging.INFO, logger="trillm"):
        family.get_kernels("auto", torch.device("cpu"), torch.float32)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")]
    assert "the cpu family" in line and "float16 KV cache" in line and quant_cpu.isas()[-1] in line
    caplog.clear()
    monkeypatch.setattr(family, "_cpu_family_runs", lambda dtype: False)
    with caplog.at_level(logging.INFO, logger="trillm"):
        family.get_kernels("auto", torch.device("cpu"), torch.float32)
    assert any(r.levelno == logging.WARNING and "torch reference kernels" in r.getMessage() for r in caplog.records)
    assert any("the torch family" in r.getMessage() for r in caplog.records)



def test_a_gguf_file_of_other_formats_runs_them_on_the_kernels_layouts(tmp_path, caplog):
    """A file whose projections are Q4_0, Q5_0, Q5_1, Q4_K, Q5_K (what llama-quantize's Q4_0,
    Q4_K_M and Q5_K_M files of the default model hold) and Q6_K: all but Q6_K come out repacked
    for the kernels, bit for bit what gguf-py dequantizes (q and k rows reordered as transformers
    does); Q6_K requantized to 8-bit blocks, each value within half a step of its block's, and the
    log says so."""
    import logging

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize
    from test_kernels import random_gguf_blocks
    from transformers import LlamaConfig

    from trillm.kernels import quant
    from trillm.model import gguf_weights

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    tensors = {"blk.0.attn_q.weight": ("q5_0", "model.layers.0.self_attn.q_proj.weight", 256),
               "blk.0.ffn_up.weight": ("q4_0", "model.layers.0.mlp.up_proj.weight", 512),
               "blk.0.ffn_down.weight": ("q4_k", "model.layers.0.mlp.down_proj.weight", 256),
               "blk.0.attn_k.weight": ("q5_k", "model.layers.0.self_attn.k_proj.weight", 128),
               "blk.0.attn_v.weight": ("q5_1", "model.layers.0.self_attn.v_proj.weight", 128),
               "blk.0.ffn_gate.weight": ("q6_k", "model.layers.0.mlp.gate_proj.weight", 512)}
    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    raw = {}
    g = torch.Generator().manual_seed(0)
    for seed, (name, (format, _, rows)) in enumerate(tensors.items()):
        if format == "q6_k":  # 210 bytes a super-block of 256, its fp16 d last
            blocks = torch.randint(0, 256, (rows, 210), generator=g, dtype=torch.uint8)
            blocks[:, 208:] = (torch.rand(rows, 1, generator=g) * 0.002).half().view(torch.uint8)
        else:
            blocks = random_gguf_blocks(format, rows, 256, seed)
        raw[name] = blocks.numpy()
        writer.add_tensor(name, raw[name], raw_dtype=GGMLQuantizationType[format.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with caplog.at_level(logging.INFO, logger="trillm"):
        got = dict(gguf_weights.quantized_weights(str(path), config, str(tmp_path)))
    assert set(got) == {hf for _, hf, _ in tensors.values()}
    assert any("1 Q6_K projections requantized to 8-bit blocks" in r.getMessage() for r in caplog.records)
    for name, (format, hf, _) in tensors.items():
        want = torch.from_numpy(np.ascontiguousarray(dequantize(raw[name], GGMLQuantizationType[format.upper()])))
        if "attn_q" in name:
            want = want[gguf_weights._unpermute(want.shape[0], config.num_attention_heads)]
        if "attn_k" in name:
            want = want[gguf_weights._unpermute(want.shape[0], config.num_key_value_heads)]
        if format != "q6_k":
            assert torch.equal(quant.dequantize(got[hf]), want), name
            continue
        assert got[hf].format == "q8_0"
        step = got[hf].scales.repeat_interleave(quant.BLOCK, dim=1)
        assert ((quant.dequantize(got[hf]) - want).abs() <= step * 0.5001).all()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
def test_files_llama_quantize_made_read_as_transformers_reads_them(kind):
    """tests/data/gguf/tiny-{kind}.gguf, a random two-layer Llama quantized by llama.cpp's own
    llama-quantize (scripts/make_tiny_gguf.py): its mix of Q4_K or Q5_K with Q6_K. On fp32 copies
    of the file's weights trillm gives transformers' logits (transformers dequantizes with
    gguf-py); on the kernels' blocks (Q4_K and Q5_K repacked exactly, Q6_K requantized to 8-bit
    blocks) it stays within that requantization's error."""
    from transformers import AutoModelForCausalLM

    from trillm.model.runner import ModelRunner

    path = os.path.join(os.path.dirname(__file__), "data", "gguf", f"tiny-{kind}.gguf")
    token_ids = list(range(3, 60))
    exact = dict(quantized_activations=False, kv_cache_dtype="float32")
    copies = ModelRunner(EngineArgs(model=path, num_kv_blocks=16, quantized_weights=False, **exact))
    blocks = ModelRunner(EngineArgs(model=path, num_kv_blocks=16, **exact))
    assert copies.model.lm_head.quantized is None and blocks.model.lm_head.quantized is not None
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    with torch.inference_mode():
        want = hf(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(copies.teacher_forced_logits(token_ids), want, atol=1e-4, rtol=1e-4)
    got = blocks.teacher_forced_logits(token_ids)
    assert (got - want).abs().max() < 0.3 and (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.85
