"""Speculative decoding's verification: a decode with k drafts gets logits at k + 1 positions
(its own last token's and each draft's) in one step; each position is sampled as decoding
without drafts would sample it there, and the run is kept up to the first position whose
sampled token differs from its draft (that token is kept too: it is what decoding would have
produced there). With no differing draft, the token after the last draft is kept as well.

Why this is exact, for greedy and sampled rows alike: position j is sampled from the target
distribution given the request's tokens and drafts 0..j-1, which are the tokens decoding would
have had if every earlier draft was kept, and only then is its token kept. For a drafter that
proposes one token with certainty (prompt lookup), this is the speculative-sampling papers'
rejection rule: the draft d is kept with probability p(d), and otherwise the token drawn is
distributed as p without d, renormalised. Every setting that reads the output so far
(penalties, min_tokens, bad words, a grammar) sees the drafts before each position, as it would
have seen them as outputs.

A seeded request keeps its stream: a position draws its noise from the request's generator
as decoding would (one draw per position, in order), and after verification the generator is
put back and advanced by the tokens kept, so the same seed gives the same tokens with drafts or
without, whatever else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trillm.engine.request import EngineRequest
from trillm.engine.sampler import draw_uniform
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import ScheduledRequest


@dataclass(frozen=True)
class DraftPosition:
    """The sampler's row for a draft's position: the request as it would stand had its drafts
    up to there been its outputs (sampler.SamplingRow)."""

    row: EngineRequest
    drafts: list[int]  # the drafts before this position

    @property
    def params(self) -> SamplingParams:
        return self.row.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.row.generator

    @property
    def token_ids(self) -> list[int]:
        return self.row.token_ids + self.drafts

    @property
    def num_prompt_tokens(self) -> int:
        return self.row.num_prompt_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.row.stop_ids


def sampling_rows(rows: list[EngineRequest], entries: list[ScheduledRequest]) -> list:
    """The sampler's rows for the requests that sample this step, in the logits' order: each
    request, then a DraftPosition per draft it verifies."""
    out: list = []
    for row, entry in zip(rows, entries, strict=True):
        out.append(row)
        drafts = entry.draft_token_ids
        out.extend(DraftPosition(row, drafts[:j]) for j in range(1, len(drafts) + 1))
    return out


def logit_groups(num_rows: list[int], limit: int | None) -> list[range]:
    """Consecutive requests (`num_rows[i]` sampled rows each) in groups of at most `limit` rows,
    each as the range of its requests' indices; a request with more rows than `limit` alone in
    its group. `limit` None: all of them in one group."""
    if limit is None:
        return [range(len(num_rows))] if num_rows else []
    groups, start, total = [], 0, 0
    for i, n in enumerate(num_rows):
        if total and total + n > limit:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(num_rows):
        groups.append(range(start, len(num_rows)))
    return groups


def verified_run(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a decode keeps from its positions' samples (`sampled`: len(drafts) + 1): up to
    and including the first that differs from its draft, or all of them."""
    assert len(sampled) == len(drafts) + 1
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[:j + 1]
    return sampled


class SeededStreams:
    """Seeded random rows' generators, saved before sampling a step with drafts and put back
    after verification as if only the kept positions had drawn."""

    def __init__(self, rows: list[EngineRequest], entries: list[ScheduledRequest]):
        self._saved = {id(row): (row.generator, row.generator.get_state()) for row, entry in zip(rows, entries)
                       if entry.draft_token_ids and row.generator is not None and not row.params.greedy}

    def keep(self, row: EngineRequest, num_kept: int) -> None:
        """`row` kept `num_kept` positions: its generator is where decoding them would leave it."""
        saved = self._saved.get(id(row))
        if saved is None:
            return
        generator, state = saved
        generator.set_state(state)
        for _ in range(num_kept):
            draw_uniform(generator)


@dataclass
class SpecDecodeCounts:
    """Drafts and acceptance since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verifications: decodes that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts kept at position j

    def count(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
