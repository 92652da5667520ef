"""Model resolution (default model, GGUF cache, HF directories) and weight loading."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from trillm.config import EngineArgs
from trillm.model.llama import Linear, rope_cos_sin_cache
from trillm.model.loader import ARCHITECTURE_FIELDS, default_model_path, load_model, resolve_model


def test_default_model_loads_in_place_with_the_converted_config_and_tokenizer(default_model_dir):
    """The GGUF file read in place gives the config, EOS and tokenizer transformers' conversion of
    it holds (tests/reference_models.py), and the same dense weights."""
    from safetensors import safe_open

    model, config, tokenizer, source = load_model(EngineArgs(quantized_weights=False))
    assert source == default_model_path()
    reference = AutoConfig.from_pretrained(default_model_dir)
    for field in (*ARCHITECTURE_FIELDS, "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id"):
        assert getattr(config.hf_config, field, None) == getattr(reference, field, None), field
    assert config.hf_config.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert (config.name, config.max_model_len, config.dtype) == ("SmolLM2-135M-Instruct", 8192, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor
    assert config.eos_token_ids == (2,) and tokenizer.eos_token_id == 2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    converted = safe_open(os.path.join(default_model_dir, "model.safetensors"), framework="pt")
    params = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.3.input_layernorm.weight"):
        assert torch.equal(params[name], converted.get_tensor(name)), name
    assert torch.equal(model.model.layers[3].self_attn.qkv_proj.weight[:576],
                       converted.get_tensor("model.layers.3.self_attn.q_proj.weight"))

    want = AutoTokenizer.from_pretrained(default_model_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|> 東京 🙂"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for text in ("Hello world", "  spaces\tand\nlines  ", "héllo <|im_end|> 東京 🙂", "x" * 300):
        assert tokenizer(text)["input_ids"] == want(text)["input_ids"], text
    assert tokenizer.all_special_tokens == want.all_special_tokens


def test_a_file_that_is_not_a_servable_gguf_is_refused_without_naming_it(tmp_path):
    """Refusals name what is wrong, never the path (a request or a log may carry them)."""
    from gguf_support import write_foreign_gguf

    from trillm.model.unservable import UnservableModel
    from trillm.model.loader import check_model

    cases = {"short.gguf": b"GGUF", "other.gguf": b"PK\x03\x04" + b"\0" * 40,
             "version.gguf": b"GGUF" + (9).to_bytes(4, "little") + b"\0" * 16,
             "cut.gguf": b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little")}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    write_foreign_gguf(str(tmp_path / "bert.gguf"))
    for name in (*cases, "bert.gguf"):
        with pytest.raises(UnservableModel) as refused:
            check_model(EngineArgs(model=str(tmp_path / name)))
        assert str(tmp_path) not in str(refused.value) and "\n" not in str(refused.value), name
    with pytest.raises(UnservableModel, match="architecture is 'bert'"):
        load_model(EngineArgs(model=str(tmp_path / "bert.gguf")))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text"])
def test_the_header_check_knows_every_tensor_shape_transformers_gives(tiny_model_dir, kind):
    """The shapes check_model holds a GGUF file's tensors to (from its header's config, without
    building the model) are those of transformers' own model of each family served: q/k/v
    biases, q/k norms, Phi-3's fused projections, Gemma's extra norms, a head_dim of its own."""
    from safetensors import safe_open

    from trillm.model.gguf_weights import hf_shape

    model_dir = tiny_model_dir(kind)
    config = AutoConfig.from_pretrained(model_dir)
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert len(shapes) > 10 and {hf_shape(name, config) for name in shapes} > {(config.hidden_size,)}
    assert {name: hf_shape(name, config) for name in shapes} == shapes


def test_resolve_model_takes_hf_dirs_and_never_a_hub_name(tiny_model_dir, tmp_path):
    assert resolve_model(tiny_model_dir("llama")) == tiny_model_dir("llama")
    assert resolve_model(None) == default_model_path()
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path), str(tmp_path / "missing.gguf")):
        with pytest.raises(FileNotFoundError):
            resolve_model(name)


def test_a_gguf_files_tokenizer_is_saved_alone_for_the_tools_that_need_a_directory(tmp_path, monkeypatch,
                                                                                 tiny_model_dir):
    from trillm.model.conversion import tokenizer_dir

    monkeypatch.setenv("TRILLM_CACHE", str(tmp_path))
    folder = tokenizer_dir(None)
    assert folder.startswith(str(tmp_path)) and "tokenizer.json" in os.listdir(folder)
    assert not [n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".gguf"))]
    assert AutoTokenizer.from_pretrained(folder)("Hello world")["input_ids"] == [19556, 905]
    assert tokenizer_dir(None) == folder and tokenizer_dir(tiny_model_dir("llama")) == tiny_model_dir("llama")
    # keyed by the file's content: a copy elsewhere (a fresh checkout's environment) finds it; a
    # changed file gets its own
    (tmp_path / "elsewhere").mkdir()
    copy = shutil.copy(default_model_path(), tmp_path / "elsewhere")
    assert tokenizer_dir(str(copy)) == folder
    with open(copy, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert tokenizer_dir(str(copy)) != folder


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


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_rope_tables_grow_on_cpu_as_contexts_do_and_decode_the_same(tiny_model_dir, monkeypatch, kind):
    """On CPU the RoPE tables start at ROPE_ROWS positions and double as steps reach further (a
    128k-position model's table would otherwise be 64 MiB from the start): a 40-token context
    grows a 16-row start to 64 rows (both of Gemma 3's, each at its own base), equal to the whole
    table's first rows, and greedy decoding gives what whole tables give."""
    import trillm
    from trillm.model import llama
    from trillm.sampling_params import SamplingParams

    model_dir = tiny_model_dir(kind)
    prompt = [[(7 * i) % 250 + 3 for i in range(40)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    monkeypatch.setattr(llama, "ROPE_ROWS", 16)
    with trillm.LLM(model=model_dir, num_kv_blocks=16) as llm:
        model = llm.engine.runner.model.model
        config = model.config
        layer_types = [None] if kind == "llama" else ["full_attention", "sliding_attention"]
        tables = lambda: [t for t in (model.cos_sin_cache, model.cos_sin_cache_sliding) if t is not None]  # noqa: E731
        assert [t.shape[0] for t in tables()] == [16] * len(layer_types)
        grown = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert [t.shape[0] for t in tables()] == [64] * len(layer_types)
        for table, layer_type in zip(tables(), layer_types):
            assert torch.equal(table, rope_cos_sin_cache(config, config.max_position_embeddings, layer_type)[:64])
    monkeypatch.setattr(llama, "ROPE_ROWS", 1 << 20)
    with trillm.LLM(model=model_dir, num_kv_blocks=16) as llm:
        assert llm.engine.runner.model.model.cos_sin_cache.shape[0] == config.max_position_embeddings
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == grown


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

    from trillm.kernels import quant
    from trillm.model.gguf_file import GGUFFile
    from trillm.model.gguf_weights import quantized_weights

    config = AutoConfig.from_pretrained(default_model_dir)
    converted = safe_open(os.path.join(default_model_dir, "model.safetensors"), framework="pt")
    formats = {}
    with GGUFFile(default_model_path()) as file:
        for name, weight in quantized_weights(file, config):
            assert torch.equal(quant.dequantize(weight), converted.get_tensor(name)), name
            formats[weight.format] = formats.get(weight.format, 0) + 1
    assert formats == {"q4_1": 7 * config.num_hidden_layers, "q8_0": 1}  # the tied embeddings are Q8_0


def test_default_model_runs_its_projections_and_lookups_on_the_gguf_blocks(default_model_dir):
    from safetensors import safe_open

    model = load_model(EngineArgs()).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 + 1 and all(m.quantized is not None and m.weight is None for m in linears)
    embeddings = model.model.embed_tokens
    assert embeddings.weight is None and embeddings.rows is not None  # looked up from the mapped file
    ids = torch.tensor([0, 2, 19556, 49151, 19556])
    table = safe_open(os.path.join(default_model_dir, "model.safetensors"), framework="pt").get_tensor(
        "model.embed_tokens.weight")
    assert torch.equal(embeddings(ids), table[ids])
    dense = load_model(EngineArgs(quantized_weights=False)).model
    assert all(m.quantized is None for m in dense.modules() if isinstance(m, Linear))
    assert dense.model.embed_tokens.rows is None


def test_the_gguf_table_is_read_as_gguf_py_reads_it():
    """Names, formats, shapes and bytes of every tensor, against gguf-py's own reader."""
    import numpy as np
    from gguf import GGUFReader

    from trillm.model.gguf_file import GGUFFile

    reader = GGUFReader(default_model_path())
    with GGUFFile(default_model_path()) as file:
        assert list(file.tensors) == [t.name for t in reader.tensors]
        assert file.metadata["llama.block_count"] == 30 and file.metadata["tokenizer.ggml.tokens"] == 49152
        for tensor in reader.tensors:
            info = file.tensors[tensor.name]
            assert (info.kind, info.nbytes) == (tensor.tensor_type, tensor.n_bytes), tensor.name
            assert np.array_equal(file.blocks(tensor.name).reshape(-1), tensor.data.reshape(-1).view(np.uint8))
            rows = file.row_reader(tensor.name)
            some = np.array([info.rows - 1, 0, 1, 2, info.rows // 2, 1]) % info.rows  # runs, repeats, any order
            assert np.array_equal(rows[some], file.blocks(tensor.name)[some])
            rows.close()
            rows.close()  # idempotent
        file.close()
        file.close()  # idempotent


def test_a_tensor_read_where_the_file_is_mapped_leaves_no_page_of_it_resident():
    """GGUFFile.mapped: a tensor's rows as the file holds them, no copy (the kernels regroup
    them from there), and once read their pages leave the process: a load that reads every
    tensor this way never holds the file's pages besides its own copy of the weights."""
    import numpy as np

    from trillm.model.gguf_file import GGUFFile

    def file_pages() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssFile:"))

    with GGUFFile(default_model_path()) as file:
        info = file.tensors["token_embd.weight"]
        before = file_pages()
        with file.mapped(info.name, slice(1, info.rows)) as rows:
            assert not rows.flags.writeable and rows.shape == (info.rows - 1, info.row_bytes)
            assert np.array_equal(rows, file.blocks(info.name)[1:])
            held = file_pages()
        assert held - before > info.nbytes * 0.9, (held, before, info.nbytes)
        assert file_pages() - before < 1 << 20, (file_pages(), before)


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



def test_a_projection_in_two_formats_of_one_layout_is_repacked_not_read_in_place(tiny_model_dir):
    """Shards still in the file (FileBlocks) go to the integer kernel unread, regrouped into a
    part a format; but where two formats of one layout meet (Q4_0's q beside Q4_1's k and v),
    repacking stacks them into one part, which the file's shards cannot make: that projection
    is repacked, and moves onto the kernel all the same instead of staying on fp32 weights."""
    import contextlib

    from test_kernels import random_gguf_blocks

    from trillm.kernels import quant, quant_cpu
    from trillm.model.loader import load_quantized_weights

    model = load_model(EngineArgs(model=tiny_model_dir("llama"))).model
    read = []
    weights, repacked = [], {0: [], 1: []}
    for layer, formats in enumerate((("q4_0", "q4_1", "q4_1"), ("q5_0", "q5_0", "q8_0"))):
        for seed, (proj, rows, format) in enumerate(zip(("q_proj", "k_proj", "v_proj"), (64, 32, 32), formats)):
            raw = random_gguf_blocks(format, rows, 64, 3 * layer + seed)

            def rows_of(which, raw=raw, layer=layer):
                read.append(layer)
                return contextlib.nullcontext(raw[which].numpy())

            repacked[layer].append(quant_cpu.from_gguf(format, raw))
            blocks = quant.FileBlocks(format, rows, 64, rows_of, None, lambda w=repacked[layer][-1]: w, rows)
            weights.append((f"model.layers.{layer}.self_attn.{proj}.weight", blocks))
    assert load_quantized_weights(model, weights) == 2
    assert set(read) == {1}, "layer 1's shards regrouped from the file, layer 0's repacked"
    x = torch.randn(3, 64)
    for layer in (0, 1):
        got = model.get_submodule(f"model.layers.{layer}.self_attn.qkv_proj").quantized
        assert isinstance(got, quant_cpu.Int8QuantizedLinear)
        want = quant_cpu.Int8QuantizedLinear(quant.cat(repacked[layer], parts=True))
        assert got.bits == want.bits == ((4,), (5, 8))[layer] and torch.equal(got(x), want(x))


def test_a_gguf_file_of_other_formats_runs_them_on_the_kernels_layouts(tmp_path, caplog):
    """A file whose projections are Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (what llama-quantize's
    Q4_0, Q4_K_M and Q5_K_M files of the default model hold): all come out repacked for the
    integer kernel, bit for bit what gguf-py dequantizes (q and k rows reordered as transformers
    does), Q6_K in its own layout. For the fp32 kernel, which has no q6_k layout, Q6_K is
    requantized to 8-bit blocks, each value within half a step of its block's, and the log says
    so."""
    import logging

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize
    from test_kernels import random_gguf_blocks
    from transformers import LlamaConfig

    from trillm.kernels import quant, quant_cpu
    from trillm.model import gguf_weights
    from trillm.model.gguf_file import GGUFFile

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

    with caplog.at_level(logging.INFO, logger="trillm"), GGUFFile(str(path)) as file:
        got = dict(gguf_weights.quantized_weights(file, config, quant_cpu.Int8QuantizedLinear))
        assert not any("requantized" in r.getMessage() for r in caplog.records)
        fp32 = dict(gguf_weights.quantized_weights(file, config, quant_cpu.QuantizedLinear))
    assert set(got) == set(fp32) == {hf for _, hf, _ in tensors.values()}
    assert any("1 Q6_K projections requantized to 8-bit blocks" in r.getMessage() for r in caplog.records)
    for name, (format, hf, _) in tensors.items():
        want = torch.from_numpy(np.ascontiguousarray(dequantize(raw[name], GGMLQuantizationType[format.upper()])))
        if "attn_q" in name:
            want = want[_unpermuted(want.shape[0], config.num_attention_heads)]
        if "attn_k" in name:
            want = want[_unpermuted(want.shape[0], config.num_key_value_heads)]
        assert got[hf].format == quant.LAYOUT_OF[format] and torch.equal(quant.dequantize(got[hf]), want), name
        if format != "q6_k":
            assert torch.equal(quant.dequantize(fp32[hf]), want), name
            continue
        assert fp32[hf].format == "q8_0"
        step = fp32[hf].scales.repeat_interleave(quant.BLOCK, dim=1)
        assert ((quant.dequantize(fp32[hf]) - want).abs() <= step * 0.5001).all()


def _unpermuted(rows: int, heads: int) -> torch.Tensor:
    """The order that undoes llama.cpp's permutation, as transformers' GGUF loader writes it."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def test_every_tensor_dequantizes_to_gguf_pys_bits_by_either_repack():
    """gguf_weights.dequantized (dense tensors, embedding rows) repacks and expands the formats the
    kernels run itself: every tensor of llama-quantize's two files (Q4_K, Q5_K, Q6_K) and of the
    default model (Q4_1, Q8_0), by the torch twin's repack and by the compiled one, is bit for bit
    gguf-py's dequantization."""
    from trillm.kernels import quant, quant_cpu
    from trillm.model.gguf_file import GGUFFile, to_float
    from trillm.model.gguf_weights import FORMATS, dequantized

    data = os.path.join(os.path.dirname(__file__), "data", "gguf")
    seen = set()
    for path in (os.path.join(data, "tiny-Q4_K_M.gguf"), os.path.join(data, "tiny-Q5_K_M.gguf"), default_model_path()):
        with GGUFFile(path) as file:
            for info in file.tensors.values():
                blocks = file.blocks(info.name)
                want = torch.from_numpy(to_float(blocks, info.kind))
                for repack in (quant.from_gguf, quant_cpu.QuantizedLinear.from_gguf):
                    assert torch.equal(dequantized(blocks, info.kind, repack), want), (path, info.name)
                seen.add(info.kind)
    assert {FORMATS[k] for k in seen if k in FORMATS} == {"q4_1", "q8_0", "q4_k", "q5_k", "q6_k"}


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


def test_slower_paths_are_logged_at_start(tiny_model_dir, tmp_path, caplog):
    """A projection the integer kernel cannot take (a vocabulary of 264 rows, not whole tiles of
    16) stays on fp32 weights; a model the fused decoder stack cannot run (Qwen2's biases)
    decodes layer by layer: each said at start, with why, never taken silently."""
    import logging

    from gguf import GGMLQuantizationType
    from gguf_support import write_gguf

    from trillm.model.runner import ModelRunner

    def load(kind: str, **config) -> tuple[ModelRunner, list]:
        path = write_gguf(tiny_model_dir(kind, **config), str(tmp_path / f"{kind}-{len(config)}.gguf"),
                          GGMLQuantizationType.Q8_0)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trillm"):
            runner = ModelRunner(EngineArgs(model=path, num_kv_blocks=16))
        return runner, [r for r in caplog.records if r.name.startswith("trillm.model")]

    runner, records = load("llama", vocab_size=264)
    assert runner.model.lm_head.quantized is None
    (moved,) = [r for r in records if "projections run on the file's quantized blocks" in r.getMessage()]
    assert moved.levelno == logging.WARNING and "stay on fp32 weights" in moved.getMessage()
    runner, records = load("qwen2")
    assert runner.model.model.decoder_stack is None
    assert any("run layer by layer" in r.getMessage() and "biases" in r.getMessage() for r in records)
    runner, records = load("llama")  # every projection on blocks, the stack runs: nothing to say
    assert runner.model.model.decoder_stack is not None
    assert not any("layer by layer" in r.getMessage() or r.levelno >= logging.WARNING for r in records)


def test_partial_rotary_embeddings_are_refused_before_loading(tiny_model_dir, tmp_path):
    """Phi-4-mini turns 3/4 of each head's dimensions: refused by check_model (so by `trillm
    serve` at once) rather than failing inside the model's construction."""
    from trillm.model.unservable import UnservableModel
    from trillm.model.loader import check_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("phi3"), model_dir)
    check_model(EngineArgs(model=str(model_dir)))
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.75
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnservableModel, match="partial rotary"):
        check_model(EngineArgs(model=str(model_dir)))
