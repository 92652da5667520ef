"""What a served model's file says about it, as Ollama's /api/tags, /api/show and /api/ps report:
format, family, parameter count, quantization, size, modification time, and the file's own
metadata (a GGUF file's key-value pairs; an HF directory's config in GGUF's key names).

Read once, in a worker thread, from the header of the file (or the headers of a directory's
safetensors files): never the weights. The `digest` names the file's version (path, size and
modification time), not a hash of its bytes, which would read gigabytes.
"""
from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from math import prod

from gguf import LlamaFileType

from trillm.model.gguf_file import GGUFFile, StringCount
from trillm.model.loader import resolve_model

# A GGUF list of numbers this long or longer (token types, scores) is sent as [] unless the client
# asks for it (Ollama's `verbose`); lists of strings (the vocabulary, the merges) always are: the
# header reader skips them.
LONG_LIST = 64


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "gguf" | "safetensors"
    family: str  # the architecture, as GGUF names it
    parameter_count: int
    quantization_level: str  # "Q4_K_M", "BF16", ...
    size: int  # bytes on disk
    modified_at: str  # RFC 3339
    digest: str
    info: dict  # Ollama's model_info, long lists left out
    long_lists: dict  # the long lists of numbers, for `verbose`

    @property
    def parameter_size(self) -> str:
        """The count as Ollama prints it: 135M, 1.7B, 8B."""
        n = self.parameter_count
        for scale, suffix, decimals in ((1e9, "B", 1), (1e6, "M", 2)):
            if n >= scale:
                value = n / scale
                return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.{decimals}f}{suffix}"
        return f"{n / 1e3:.0f}K" if n >= 1e3 else str(n)

    def details(self) -> dict:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}


def read_facts(model: str | None, hf_config, context_length: int) -> ModelFacts:
    """Facts of the GGUF file or HF directory `model` names (None: the default model's file);
    `hf_config` and `context_length` (the served context) fill what a directory's files do not say."""
    path = resolve_model(model)
    if os.path.isfile(path):
        return _gguf_facts(path)
    return _directory_facts(path, hf_config, context_length)


def _stamp(paths: list[str]) -> tuple[int, str, str]:
    """Total size, the latest modification time (RFC 3339) and the version digest of `paths`."""
    stats = [os.stat(p) for p in paths]
    size = sum(s.st_size for s in stats)
    mtime = max((s.st_mtime for s in stats), default=0.0)
    version = "\n".join(f"{os.path.abspath(p)}:{s.st_size}:{s.st_mtime_ns}" for p, s in zip(paths, stats))
    when = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return size, when, hashlib.sha256(version.encode()).hexdigest()


def _gguf_facts(path: str) -> ModelFacts:
    with GGUFFile(path) as file:
        metadata = dict(file.metadata)
        count = sum(prod(t.shape) for t in file.tensors.values())
    file_type = metadata.get("general.file_type")
    try:
        level = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        level = "unknown"
    long_lists = {k: v for k, v in metadata.items() if isinstance(v, list) and len(v) >= LONG_LIST}
    info = {k: [] if k in long_lists or isinstance(v, StringCount) else v for k, v in metadata.items()}
    info["general.parameter_count"] = count
    size, when, digest = _stamp([path])
    return ModelFacts("gguf", metadata.get("general.architecture", "unknown"), count, level, size, when, digest,
                      info, long_lists)


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _directory_facts(path: str, hf_config, context_length: int) -> ModelFacts:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    count, dtypes = 0, set()
    for name in files:
        for key, tensor in _safetensors_header(name).items():
            if key != "__metadata__":
                count += prod(tensor["shape"])
                dtypes.add(tensor["dtype"])
    arch = hf_config.model_type
    config = {"context_length": context_length, "embedding_length": hf_config.hidden_size,
              "block_count": hf_config.num_hidden_layers,
              "feed_forward_length": getattr(hf_config, "intermediate_size", None),
              "attention.head_count": hf_config.num_attention_heads,
              "attention.head_count_kv": getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
              "vocab_size": hf_config.vocab_size}
    info = {"general.architecture": arch, "general.parameter_count": count,
            **{f"{arch}.{k}": v for k, v in config.items() if v is not None}}
    size, when, digest = _stamp(files)
    level = "/".join(sorted(dtypes)) if dtypes else "unknown"
    return ModelFacts("safetensors", arch, count, level, size, when, digest, info, {})
