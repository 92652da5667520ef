"""HF directories made from a GGUF file, for the tools that take nothing else: a load generator or
a peer server that reads a tokenizer directory (`tokenizer_dir`), a peer server or a test's
reference that reads an HF model directory (`hf_directory`, transformers' own conversion, fp32).
trillm never serves from them (it reads the file in place); they are made only when a tool asks,
once per file, under the cache root.

Each is written to a temporary directory renamed into place, behind a lock, so that concurrent
processes wait for one writer and none ever sees half a directory. A directory is keyed by the
file's content, not its path: a file of up to CONTENT_HASH_BYTES by its whole bytes, so another
copy of it (a fresh checkout's environment installs the default model anew) finds the one
made before; a larger one by its size, mtime, first and last MiB. A changed file gets a new one.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable

import torch

from trillm.model import gguf_model
from trillm.model.gguf_file import GGUFFile
from trillm.model.loader import gguf_file, resolve_model
from trillm.model.unservable import UnservableModel


def cache_root() -> str:
    return os.environ.get("TRILLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trillm")


def tokenizer_dir(model: str | None) -> str:
    """A directory holding `model`'s tokenizer files: an HF directory is its own; a GGUF file's
    tokenizer (and chat template) is saved alone, no weight with it."""
    path = resolve_model(model)
    if gguf_file(path) is None:
        return path

    def write(out_dir: str) -> None:
        with GGUFFile(path) as file:
            tokenizer = gguf_model.tokenizer(file)
        if tokenizer is None:
            raise UnservableModel("The model file holds no tokenizer.")
        tokenizer.save_pretrained(out_dir)

    return _made_once(path, "tokenizers", write)


def hf_directory(gguf_path: str) -> str:
    """transformers' conversion of `gguf_path`: dequantized fp32 weights (Q4 values are exact in
    fp32, not in bf16), the tokenizer with its chat template, the generation config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(out_dir: str) -> None:
        folder, name = os.path.split(os.path.abspath(gguf_path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The weights are dequantized already; without this the saved config claims GGUF quantization.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)

    return _made_once(gguf_path, "hf", write)


CONTENT_HASH_BYTES = 512 << 20  # files up to this are keyed by their whole content (~0.3 s a 100 MB file)
_EDGE_BYTES = 1 << 20


def _content_digest(path: str) -> str:
    """What keys `path`'s directories: its content's hash, or for a large file its size, mtime
    and the hash of its first and last MiB (see the module's docstring)."""
    stat = os.stat(path)
    digest = hashlib.sha256(str(stat.st_size).encode())
    with open(path, "rb") as f:
        if stat.st_size <= CONTENT_HASH_BYTES:
            hashlib.file_digest(f, lambda: digest)
        else:
            digest.update(str(stat.st_mtime_ns).encode())
            digest.update(f.read(_EDGE_BYTES))
            f.seek(-_EDGE_BYTES, os.SEEK_END)
            digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:12]


def _made_once(gguf_path: str, kind: str, write: Callable[[str], None]) -> str:
    """The directory `write` fills for this file, made the first time it is asked for."""
    path = os.path.abspath(gguf_path)
    digest = _content_digest(path)
    root = os.path.join(cache_root(), kind)
    target = os.path.join(root, f"{os.path.splitext(os.path.basename(path))[0]}-{digest}")
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(target):
            tmp = tempfile.mkdtemp(dir=root, prefix=".writing-")
            try:
                write(tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it private
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
