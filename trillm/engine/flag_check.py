"""The engine's flags that a value can be wrong in beyond its type (a JSON object's keys; a
choice among names is a StrEnum, which argparse checks itself), checked before anything loads:
`trillm serve` refuses a bad one at once, in argparse's words, where the engine would find it
only after loading the model. Imports neither torch nor the model, so the data-parallel
supervisor, which runs no engine, checks them too."""
from __future__ import annotations

from trillm.config import EngineArgs
from trillm.engine.drafting import SpeculativeConfig
from trillm.engine.kv_events import KVEventsConfig


def check_flags(args: EngineArgs) -> None:
    """ValueError, naming the flag, for the first value of `args` the engine would refuse."""
    SpeculativeConfig.parse(args.speculative_config)
    KVEventsConfig.parse(args.kv_events_config)
    check_lora_args(args)
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError("--max-num-batched-tokens is the most tokens a step computes: at least 1")


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
