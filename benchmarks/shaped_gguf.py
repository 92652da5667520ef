"""Random-weight GGUF files of real models' shapes (Llama, Qwen2.5, Qwen3, Phi-3), quantized by
llama.cpp's own llama-quantize, for
measuring trillm and llama.cpp at the sizes people run (the files are never committed).

    .venv/bin/python benchmarks/shaped_gguf.py --llama-cpp PATH --shape smollm2-1.7b --type Q4_K_M --out DIR

An F16 file is written tensor by tensor (never held whole in memory: an 8B one is 16 GB), weights
drawn from N(0, 0.02) with a fixed seed, norms at 1, with the default model's tokenizer (SmolLM2's
vocabulary, padded with unused tokens to the shape's vocabulary size); `llama-quantize` then makes
the quantized file (its own mix of formats, e.g. Q4_K with Q6_K for Q4_K_M), and the F16 file is
removed. The output is `<shape>-<type>.gguf` in DIR; an existing one is kept.
"""
from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

# hidden, intermediate, layers, heads, KV heads, vocabulary, tied embeddings, RoPE base, context;
# arch: llama.cpp's architecture (qwen2: q/k/v biases; qwen3: q/k norms and head_dim of its own;
# phi3: q|k|v and gate|up fused, attention within a sliding window). Phi-3-mini's shape keeps the
# default model's 49152-token vocabulary, not its own 32064: the tokenizer comes from that file.
SHAPES = {
    "smollm2-1.7b": dict(hidden=2048, inter=8192, layers=24, heads=32, kv_heads=32, vocab=49152, tied=True,
                         rope_base=130000.0, context=8192),
    "llama-3.2-3b": dict(hidden=3072, inter=8192, layers=28, heads=24, kv_heads=8, vocab=128256, tied=True,
                         rope_base=500000.0, context=131072),
    "llama-3.1-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, tied=False,
                         rope_base=500000.0, context=131072),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, vocab=151936,
                         tied=True, rope_base=1000000.0, context=32768),
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, inter=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                       vocab=151936, tied=True, rope_base=1000000.0, context=40960),
    "phi-3-mini": dict(arch="phi3", hidden=3072, inter=8192, layers=32, heads=32, kv_heads=32, vocab=49152,
                       tied=False, rope_base=10000.0, context=4096, sliding_window=2047),
}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token")


def tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, torch-order shape) of every tensor, in llama.cpp's order."""
    hidden, inter, head_dim = shape["hidden"], shape["inter"], head_dim_of(shape)
    q, kv = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    out = [("token_embd.weight", (shape["vocab"], hidden))]
    for i in range(shape["layers"]):
        if shape.get("arch") == "phi3":
            out += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_qkv.weight", (q + 2 * kv, hidden)),
                    (f"blk.{i}.attn_output.weight", (hidden, q)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
                    (f"blk.{i}.ffn_up.weight", (2 * inter, hidden)), (f"blk.{i}.ffn_down.weight", (hidden, inter))]
            continue
        out += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_q.weight", (q, hidden)),
                (f"blk.{i}.attn_k.weight", (kv, hidden)), (f"blk.{i}.attn_v.weight", (kv, hidden)),
                (f"blk.{i}.attn_output.weight", (hidden, q)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
                (f"blk.{i}.ffn_gate.weight", (inter, hidden)), (f"blk.{i}.ffn_up.weight", (inter, hidden)),
                (f"blk.{i}.ffn_down.weight", (hidden, inter))]
        if shape.get("arch") == "qwen2":
            out += [(f"blk.{i}.attn_q.bias", (q,)), (f"blk.{i}.attn_k.bias", (kv,)), (f"blk.{i}.attn_v.bias", (kv,))]
        if shape.get("arch") == "qwen3":
            out += [(f"blk.{i}.attn_q_norm.weight", (head_dim,)), (f"blk.{i}.attn_k_norm.weight", (head_dim,))]
    out.append(("output_norm.weight", (hidden,)))
    if not shape["tied"]:
        out.append(("output.weight", (shape["vocab"], hidden)))
    return out


def head_dim_of(shape: dict) -> int:
    return shape.get("head_dim", shape["hidden"] // shape["heads"])


def write_f16(name: str, path: Path) -> None:
    """The shape's F16 file, tensor by tensor."""
    from trillm.model.gguf_file import GGUFFile
    from trillm.model.loader import default_model_path

    shape = SHAPES[name]
    writer = GGUFWriter(str(path), shape.get("arch", "llama"))
    # llama.cpp sets Phi-3's special tokens' attributes by a name holding "phi-3", and this file has
    # another model's vocabulary, without them: the name leaves out the hyphens
    writer.add_name(f"random {name}".replace("-", " "))
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["inter"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_rope_dimension_count(head_dim_of(shape))
    writer.add_key_length(head_dim_of(shape))
    writer.add_value_length(head_dim_of(shape))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(1)  # mostly F16
    if "sliding_window" in shape:
        writer.add_sliding_window(shape["sliding_window"])
    with GGUFFile(default_model_path()) as source:
        metadata = source.metadata
    from gguf import GGUFReader  # the vocabulary's strings, which GGUFFile only counts

    reader = GGUFReader(default_model_path())
    fields = {key: reader.fields[key] for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                  "tokenizer.ggml.token_type")}
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    padding = shape["vocab"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(padding)]
    types += [5] * padding  # llama.cpp's UNUSED
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(metadata["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(False)
    layout = tensors(shape)
    for tensor, dims in layout:
        kind = GGMLQuantizationType.F32 if len(dims) == 1 else GGMLQuantizationType.F16
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(tensor, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tensor, dims in layout:
        if len(dims) == 1:  # norms at 1, biases at 0
            writer.write_tensor_data((np.zeros if tensor.endswith(".bias") else np.ones)(dims, dtype=np.float32))
            continue
        data = np.empty(dims, dtype=np.float16)
        for start in range(0, dims[0], 4096):  # a slice at a time: an fp32 draw of the whole is GBs
            stop = min(start + 4096, dims[0])
            data[start:stop] = (rng.standard_normal((stop - start, dims[1]), dtype=np.float32) * 0.02)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's tree, llama-quantize built")
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/models"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.shape}-{args.type}.gguf"
    if target.exists():
        print(target)
        return
    f16 = args.out / f"{args.shape}-F16.gguf"
    write_f16(args.shape, f16)
    try:
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(target), args.type,
                        str(os.cpu_count())], check=True)
    finally:
        f16.unlink()
    print(target)


if __name__ == "__main__":
    main()
