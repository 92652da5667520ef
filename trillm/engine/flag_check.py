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
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError("--max-num-batched-tokens is the most tokens a step computes: at least 1")
