"""Engine settings: one dataclass shared by the offline API, the server's flags and the benchmarks;
the enums of the fields that take one of a fixed set of names; and the reading of the flags that
take a JSON object (--speculative-config, --kv-events-config).

A field's value is checked once, here, when EngineArgs is made (a flag's by argparse before
that, from the enum's names): the loader and the kernels take the members as they are."""
from __future__ import annotations

import enum
import json
import os
import typing
from dataclasses import dataclass, fields

from trillm.pooling_params import PoolingType
from trillm.sched_ext.status import PrefixHashAlgo, SchedulingPolicy

CPU_KV_CACHE_SHARE = 0.5  # of the memory available: kv_cache_memory's default on CPU


def available_memory(cgroup: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> int:
    """Bytes this process can still take without swapping: Linux's MemAvailable (elsewhere the
    free pages), and no more than its cgroup's (v2) limit leaves, as in a container."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open(meminfo) as lines:
            available = next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as limit, open(os.path.join(cgroup, "memory.current")) as used:
            bound = limit.read().strip()
            if bound != "max":
                available = min(available, max(0, int(bound) - int(used.read())))
    except (OSError, ValueError):
        pass
    return available


def default_kv_cache_memory(replicas: int = 1) -> int:
    """kv_cache_memory's default: each of `replicas` engines sharing this machine takes its part
    of CPU_KV_CACHE_SHARE of the memory available now."""
    return int(CPU_KV_CACHE_SHARE * available_memory()) // replicas


class DType(enum.StrEnum):
    """The weights' and activations' dtype (`--dtype`)."""

    AUTO = "auto"  # fp32 on CPU, bf16 on CUDA
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class KVCacheDType(enum.StrEnum):
    """The KV cache's element type (`--kv-cache-dtype`)."""

    AUTO = "auto"  # fp16 on the cpu family when the model is fp32, else the model's dtype
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"  # each token's row of each head quantized with its own scale


class LoadFormat(enum.StrEnum):
    AUTO = "auto"  # the weights in the model's file or directory
    DUMMY = "dummy"  # random weights from the config


class Device(enum.StrEnum):
    """Where the model runs (`--device`); a CUDA machine's GPU is chosen by CUDA_VISIBLE_DEVICES."""

    AUTO = "auto"  # CUDA where torch sees a device, else the CPU
    CPU = "cpu"
    CUDA = "cuda"


class AttentionBackend(enum.StrEnum):
    """The kernel family every op runs on (trillm.kernels.family, `--attention-backend`)."""

    AUTO = "auto"  # triton on CUDA; on CPU the cpu family where it is built and runs the dtype, else torch
    TORCH = "torch"  # the torch twins, the reference
    CPU = "cpu"  # the compiled CPU kernels
    TRITON = "triton"


def _member(kind: type[enum.StrEnum], field: str, value):
    """`value` as a member of `kind`; ValueError naming the field and the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field} is one of {', '.join(kind)}; got {value!r}.") from None


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory, .gguf file, or None for the default model
    dtype: DType = DType.AUTO
    load_format: LoadFormat = LoadFormat.AUTO
    device: Device = Device.AUTO
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    # A GGUF model's Q4_1 / Q8_0 projections run on their blocks where the kernels can (the cpu
    # family, fp32); off: on the fp32 weights they dequantize to, as every other model does
    quantized_weights: bool = True
    # ... and, on the cpu family, as integer dot products with each activation row quantized to
    # 8-bit blocks (trillm/kernels/quant_int8_cpu.h); off: fp32 activations, the exact path
    quantized_activations: bool = True
    seed: int = 0  # seeds dummy weights and unseeded sampling
    block_size: int = 16
    # auto: fp16 on the cpu family when the model is fp32 (decode attention streams the cache, and
    # fp16 halves it), else the model's dtype; int8: trillm/kernels/cache.py
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    # bytes of KV cache on CPU, all tensor-parallel ranks together (never more blocks than
    # max_num_seqs full-length sequences fill); None: default_kv_cache_memory(), read once the
    # weights are in (its pages become resident only as blocks are written)
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + activations + KV on CUDA
    num_kv_blocks: int | None = None  # overrides both budgets (tests use tiny pools)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # the tokens one step computes at most; None: the device's default (model.loader's
    # CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS), resolved into ModelConfig
    max_num_batched_tokens: int | None = None
    # The query-key pairs a step's prompt chunks may attend over while a request decodes
    # (trillm/sched_ext/scheduler.pyx): a late chunk of a long prompt is cut, so a step's cost
    # stays bounded and decoding requests beside it wait no longer for their next token. None:
    # on CPU a fresh 512-token chunk's; on CUDA what the projections of max_num_batched_tokens
    # tokens cost (engine.core.prefill_pairs_budget); 0: no limit
    max_prefill_pairs: int | None = None
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    # How the prefix cache keys its blocks (trillm/sched_ext/allocator.pyx): builtin (Python's
    # hash, the fastest) or sha256_cbor (vLLM's, so routers that hash prompts as vLLM does find
    # the blocks that --kv-events-config publishes)
    prefix_caching_hash_algo: PrefixHashAlgo = PrefixHashAlgo.BUILTIN
    # fcfs: arrival order; priority: a request's `priority` first (lower runs first, vLLM's), then
    # arrival, and the worst-ranked running request is the one preempted
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    num_threads: int = 1  # torch intra-op threads on CPU
    # threads of the compiled CPU kernels (trillm/kernels/pool_cpu.h), the step's included;
    # None: one per core this process may run on
    kernel_threads: int | None = None
    # How embedding requests pool the prompt's final hidden states. None: the model's
    # sentence-transformers config (modules.json's Pooling module), else last
    pooling_type: PoolingType | None = None
    # Tensor parallelism (trillm/model/parallel.py): ranks that shard the model. With more than
    # one, the engine starts the other ranks itself unless a launcher (torchrun) started them.
    tensor_parallel_size: int = 1
    tp_cpu_binding: bool = True  # on CPU, each rank's threads on its own cores (its NUMA node's)
    tp_timeout: float = 60.0  # seconds a step's collectives wait for a late rank before failing
    # where the ranks meet (tcp://host:port); None: a free loopback port (ranks on one machine)
    tp_init_method: str | None = None
    # LoRA adapters (trillm/model/lora.py), vLLM's flags: requests may name adapters loaded from
    # PEFT directories; `lora_modules` loads some at start ("name=path", several separated by
    # commas); at most `max_loras` distinct adapters run in one step, of rank up to
    # `max_lora_rank`; `max_cpu_loras` adapters keep their weights in host memory (None: max_loras)
    enable_lora: bool = False
    lora_modules: str | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Seconds a structured-output grammar may compile (trillm/engine/grammar_compiler.py): a
    # longer compile is stopped and its request refused with a 400 naming the field
    grammar_compile_timeout: float = 10.0
    # /sleep may free the KV cache (level 1) and the weights (level 2) until /wake_up
    enable_sleep_mode: bool = False
    # Speculative decoding (trillm/engine/drafting.py), vLLM's JSON: {"method": "ngram" | "suffix",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": n,
    # "disable_by_batch_size": b, ...}; on by default (suffix drafts, 6 at most: benchmarks/README.md
    # has the figures that chose them; without disable_by_batch_size, drafted at a batch size while
    # drafting measures faster there). "" or None: off
    speculative_config: str | None = '{"method": "suffix", "num_speculative_tokens": 6}'
    # KV-cache events for cache-aware routers (trillm/engine/kv_events.py), vLLM's JSON:
    # {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ...}. None: off
    kv_events_config: str | None = None
    # This replica's rank behind a data-parallel front door: its events carry it, and its event
    # ports are the configured ones plus it (set by the supervisor)
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        # a member's name as a string is taken too, and becomes the member
        for field, kind in _CHOICES.items():
            value = getattr(self, field)
            if value is not None:
                setattr(self, field, _member(kind, field, value))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _enum_fields(cls) -> dict[str, type[enum.StrEnum]]:
    """The fields annotated with a StrEnum (or one or None): name -> the enum."""
    chosen = {}
    for name, hint in typing.get_type_hints(cls).items():
        kinds = [k for k in typing.get_args(hint) or (hint,) if isinstance(k, type) and issubclass(k, enum.StrEnum)]
        if kinds:
            (chosen[name],) = kinds
    return chosen


_CHOICES = _enum_fields(EngineArgs)

# A JSON flag's field types (as annotated, a string) -> the JSON values each takes, and their name
_JSON_KINDS = {
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "str | None": ((str, type(None)), "a string or null"),
    "int": ((int,), "an integer"),
    "int | None": ((int, type(None)), "an integer or null"),
    "float": ((int, float), "a number"),
}


def from_json_object(cls, flag: str, text: str):
    """`cls` (a dataclass of plain fields) made from a flag's JSON object, its keys the fields';
    ValueError naming the flag and the key for text that is not such an object, an unknown key,
    or a value of the wrong JSON type (true is not an integer); `cls` checks the values."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc.msg}.") from None
    if not isinstance(values, dict):
        raise ValueError(f"{flag} takes a JSON object.")
    kinds = {f.name: f.type for f in fields(cls)}
    for key, value in values.items():
        if key not in kinds:
            raise ValueError(f"{flag}: unknown key {key!r}; the keys are {', '.join(kinds)}.")
        accepted, name = _JSON_KINDS[kinds[key]]
        if type(value) not in accepted:
            raise ValueError(f"{flag}: {key} must be {name}.")
    return cls(**values)
