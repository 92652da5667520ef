"""Makes tests/data/gguf/tiny-{Q4_K_M,Q5_K_M}.gguf: a random-weight two-layer Llama quantized by
llama.cpp's own `llama-quantize`, so that the tests read K-quant files exactly as llama.cpp writes
them (its mix of Q4_K / Q5_K / Q6_K tensors, its metadata), a few hundred KB each.

    .venv/bin/python scripts/make_tiny_gguf.py --llama-cpp .peers/llama.cpp

Needs llama.cpp's source tree with `llama-quantize` built (build/bin) and, for its converter,
`sentencepiece` installed. The model: hidden 256 (K-quant rows are multiples of 256), 2 layers,
4 query and 2 KV heads, weights drawn from N(0, 0.05) with seed 0, and the default model's
tokenizer cut to its first 512 tokens (with the merges among them), so the embedding is small.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512
TYPES = ("Q4_K_M", "Q5_K_M")


def random_model(out: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trillm.model.conversion import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def cut_vocab(source: Path, out: Path) -> None:
    """The f32 file again with its first VOCAB tokens only: the embedding's rows, the token list
    and types, and the merges whose parts and result are all kept."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tokens = fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents()
              if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    replaced = {"llama.vocab_size": VOCAB, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"].contents()[:VOCAB],
                "tokenizer.ggml.merges": merges}
    writer = GGUFWriter(out, fields["general.architecture"].contents())
    for key, field in fields.items():
        if key == "general.architecture":
            continue
        value = replaced.get(key, field.contents())
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "token_embd.weight":
            data = data[:VOCAB]
        writer.add_tensor(tensor.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree, llama-quantize built")
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "gguf"))
    args = parser.parse_args()
    llama_cpp = Path(args.llama_cpp).resolve()
    bin_dir = llama_cpp / "build" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        random_model(tmp / "hf")
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(tmp / "hf"), "--outfile",
                        str(tmp / "full.gguf"), "--outtype", "f32"], check=True, capture_output=True)
        cut_vocab(tmp / "full.gguf", tmp / "tiny-f32.gguf")
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        for kind in TYPES:
            subprocess.run([str(bin_dir / "llama-quantize"), str(tmp / "tiny-f32.gguf"),
                            str(Path(args.out) / f"tiny-{kind}.gguf"), kind], check=True, capture_output=True, env=env)
            print(Path(args.out) / f"tiny-{kind}.gguf")


if __name__ == "__main__":
    main()
