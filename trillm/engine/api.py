"""The engine's one door: everything the HTTP layer (or any other front) may use of it.

A front builds an EngineCore (loading the model), or an EngineProcess (loading it in a process
of its own); either is then only handed to AsyncEngine and closed. It talks to AsyncEngine alone,
and reads the records that cross the boundary: a request group going in, a RequestStream of
StepOutputs and Deltas coming out, the stats. Nothing else in `trillm.engine` or `trillm.model`
is for it; a test (tests/test_layering.py) holds the line.
"""
from trillm.engine.async_engine import AsyncEngine, RequestStream
from trillm.engine.core import EngineCore, StepOutput
from trillm.engine.core_process import EngineLink, EngineProcess, faster_in_own_process
from trillm.engine.detokenizer import held_prefix_len
from trillm.engine.errors import EngineUnavailableError, QueueFullError, WeightsError
from trillm.engine.group import Params, RequestGroup, num_samples
from trillm.engine.kv_events import KVEventsConfig, offset_endpoint
from trillm.engine.output import Delta, OutputProcessor, PoolingProcessor, output_processor
from trillm.engine.sampler import TokenLogprobs
from trillm.engine.stats import ServingStats
from trillm.engine.token_bytes import ByteDecoder, DecoderKind, tokenizer_part
from trillm.model.facts import ModelFacts, read_facts
from trillm.model.lora import LoRAError
from trillm.model.tp_worker import launcher_init_method, launcher_rank, run_worker
from trillm.sched_ext import FinishReason

__all__ = [
    "AsyncEngine", "ByteDecoder", "DecoderKind", "Delta", "EngineCore", "EngineLink", "EngineProcess",
    "EngineUnavailableError", "FinishReason", "KVEventsConfig", "LoRAError", "ModelFacts", "OutputProcessor", "Params",
    "PoolingProcessor", "QueueFullError", "RequestGroup", "RequestStream", "ServingStats", "StepOutput",
    "TokenLogprobs", "WeightsError", "faster_in_own_process", "held_prefix_len", "launcher_init_method",
    "launcher_rank", "num_samples", "offset_endpoint", "output_processor", "read_facts", "run_worker",
    "tokenizer_part",
]
