"""trillm: an OpenAI-compatible LLM inference server.

`LLM` is imported lazily so that `trillm.sched_ext` and `trillm.sampling_params`
stay importable without torch.
"""
from trillm.pooling_params import PoolingParams, PoolingType
from trillm.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "PoolingParams", "PoolingType", "SamplingParams", "StructuredOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from trillm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'trillm' has no attribute {name!r}")
