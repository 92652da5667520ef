"""EngineRequest: one live engine request, everything about it in one record.

The scheduler's Cython `Request` holds what scheduling needs (tokens, blocks, status, the
stop set); this record wraps it with what the rest of a step needs: the sampling (or pooling)
params, the request's own random generator, its grammar matcher, its LoRA adapter, and what it gathers from the
steps' hidden states (prompt logprobs, a pooled vector) until it is delivered. `EngineCore` keeps one dict of these,
from `add_request` until the request finishes or is aborted, when its one entry goes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trillm.model.lora import LoRAAdapter
from trillm.engine.drafting import Drafter
from trillm.engine.pooler import Pooler
from trillm.engine.prompt_logprobs import PromptLogprobs
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import Request


@dataclass(eq=False)
class EngineRequest:
    seq: Request  # the scheduler's record; the stop set is its stop_token_ids
    params: SamplingParams | PoolingParams
    generator: torch.Generator | None  # made from params.seed at admission; None: the global one
    matcher: object | None = None  # the xgrammar GrammarMatcher of a constrained request
    # Filled from the steps' hidden states; None once delivered (or never asked).
    prompt_logprobs: PromptLogprobs | None = None
    pooler: Pooler | None = None
    lora: LoRAAdapter | None = None  # its adapter, held (LoRARegistry.acquire) until it ends
    drafter: Drafter | None = None  # where its drafts come from (None: no speculative decoding)

    @property
    def wants_hidden(self) -> bool:
        """Its chunks' hidden states are needed this step."""
        return self.prompt_logprobs is not None or self.pooler is not None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    # What the sampler reads of it (sampler.SamplingRow).
    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.seq.stop_token_ids
