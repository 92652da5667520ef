"""EngineRequest: one live engine request, everything about it in one record.

The scheduler's Cython `Request` holds what scheduling needs (tokens, blocks, status, the
stop set); this record wraps it with what the rest of a step needs: the sampling params, the
request's own random generator, its grammar matcher. `EngineCore` keeps one dict of these,
from `add_request` until the request finishes or is aborted, when its one entry goes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trillm.sampling_params import SamplingParams
from trillm.sched_ext import Request


@dataclass(eq=False)
class EngineRequest:
    seq: Request  # the scheduler's record; the stop set is its stop_token_ids
    params: SamplingParams
    generator: torch.Generator | None  # made from params.seed at admission; None: the global one
    matcher: object | None = None  # the xgrammar GrammarMatcher of a constrained request

    @property
    def request_id(self) -> str:
        return self.seq.request_id
