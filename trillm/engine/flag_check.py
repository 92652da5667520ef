"""The engine's flags that a value can be wrong in beyond its type (a JSON object's keys; a
choice among names is a StrEnum, which argparse checks itself), checked before anything loads:
`trillm serve` refuses a bad one at once, in argparse's words, where the engine would find it
only after loading the model. Imports neither torch nor the model, so the data-parallel
supervisor, which runs no engine, checks them too."""
from __future__ import annotations

from trillm.config import EngineArgs
from trillm.engine.drafting import SpeculativeConfig
from trillm.engine.kv_events import KVEventsConfig


# The numbers with a least value: what each is, and that value (None leaves a default alone).
AT_LEAST = {
    "block_size": ("the tokens a KV-cache block holds", 1),
    "num_kv_blocks": ("the KV cache's blocks", 1),
    "max_model_len": ("the longest context a request may reach", 1),
    "max_num_batched_tokens": ("the most tokens a step computes", 1),
    "max_prefill_pairs": ("the query-key pairs a step's prompt chunks attend over, 0 for no limit", 0),
    "max_num_seqs": ("the most requests a step runs", 1),
    "num_threads": ("torch's intra-op threads", 1),
    "kernel_threads": ("the compiled kernels' threads", 1),
    "tensor_parallel_size": ("the ranks that shard the model", 1),
}
# Seconds that must be some: 0 would fail every wait at once.
POSITIVE_SECONDS = {
    "tp_timeout": "the seconds a step's collectives wait for a late rank",
    "grammar_compile_timeout": "the seconds a grammar may compile",
}


def check_flags(args: EngineArgs) -> None:
    """ValueError, naming the flag, for the first value of `args` the engine would refuse."""
    for field, (what, least) in AT_LEAST.items():
        value = getattr(args, field)
        if value is not None and value < least:
            raise ValueError(f"{_flag(field)} is {what}: at least {least}")
    for field, what in POSITIVE_SECONDS.items():
        if not getattr(args, field) > 0:
            raise ValueError(f"{_flag(field)} is {what}: more than 0")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"{_flag('gpu_memory_utilization')} is a share of the GPU's memory: more than 0, at most 1")
    SpeculativeConfig.parse(args.speculative_config)
    KVEventsConfig.parse(args.kv_events_config)
    check_lora_args(args)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def parse_lora_modules(spec: str | None) -> list[tuple[str, str]]:
    """`--lora-modules`: "name=path" items, separated by commas (or spaces)."""
    items = [] if not spec else [item for part in spec.split(",") for item in part.split()]
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items; got {item!r}.")
        pairs.append((name, path))
    return pairs


def check_lora_args(args: EngineArgs) -> None:
    """ValueError for LoRA settings that cannot run."""
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    if not args.enable_lora:
        return
    parse_lora_modules(args.lora_modules)
    if args.tensor_parallel_size > 1:
        raise ValueError("LoRA adapters are not supported under tensor parallelism yet; use --data-parallel-size.")
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1.")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError("--max-cpu-loras must be at least --max-loras.")
