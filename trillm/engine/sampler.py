"""The batched sampler: one step's logits [N, V] -> one token (and logprobs) per row.

Every stage works on the whole batch at once and is skipped when no row needs it:
an all-greedy batch without penalties is one argmax. Python loops run over
requests, never over the vocabulary; the only per-row tensor work is drawing a
seeded row's noise from its own generator.

Order of operations (vLLM's):
  1. logprobs, from the RAW logits (log-softmax before anything below): what the
     model believes, not what the sampling settings made of it; OpenAI and vLLM
     report these.
  2. logit_bias, then the masks: every token outside allowed_token_ids, the last token
     of a bad word whose other tokens end the output, and the min_tokens mask (the
     request's stop set, its EOS ids and stop_token_ids, gets -inf while it has fewer
     than min_tokens outputs); then the repetition penalty
     (prompt + output tokens) and the frequency / presence penalties (output
     tokens only).
  3. greedy rows: argmax. Random rows: temperature, top-k, top-p, min-p (each a
     threshold on the row, found among its largest values; `truncate`), then
     inverse-CDF sampling: one uniform number u per
     row, and the first token whose cumulative probability exceeds u, which draws
     exactly from `probs`.

Why one number per row: a seeded row draws it from its own generator and gets the
same token whatever else shares the batch and in whichever position, and the cost is a
cumulative sum, where a number per (row, token) (the exponential race) cost more than a
decode step's model at a batch of 32 over a 49k vocabulary.
"""
from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trillm.sampling_params import SamplingParams

_SAMPLING_CPU_BUILT = importlib.util.find_spec("trillm.kernels.sampling_cpu") is not None


@dataclass
class TokenLogprobs:
    """The sampled (or prompt) token's raw logprob and the top-n raw logprobs, highest first;
    `rank`, where computed (prompt logprobs), the token's 1-based place in its distribution."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(frozen=True)
class SamplingBatch:
    """What the sampler needs of one step's rows, built once per step (`of`); one entry per
    logits row, held by column because the sampler works on whole columns at once."""

    params: list[SamplingParams]
    token_ids: list[list[int]]  # prompt + output so far
    num_prompt_tokens: list[int]
    generators: list[torch.Generator | None]  # a seeded row's own generator
    stop_ids: list[frozenset[int]]  # SamplingParams.stop_token_set: masked until min_tokens

    def __post_init__(self) -> None:
        n = len(self.params)
        assert n == len(self.token_ids) == len(self.num_prompt_tokens) == len(self.generators) == len(self.stop_ids)

    @classmethod
    def of(cls, rows: Sequence[SamplingRow]) -> SamplingBatch:
        """The batch of `rows`, one per logits row, in their order."""
        batch = cls([], [], [], [], [])
        for row in rows:
            batch.params.append(row.params)
            batch.token_ids.append(row.token_ids)
            batch.num_prompt_tokens.append(row.num_prompt_tokens)
            batch.generators.append(row.generator)
            batch.stop_ids.append(row.stop_ids)
        return batch


class SamplingRow(Protocol):
    """What the sampler reads of one row's request (the engine's EngineRequest is one)."""

    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own generator

    @property
    def token_ids(self) -> list[int]: ...  # prompt + output so far

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...  # SamplingParams.stop_token_set: masked until min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request asked for none


class Sampler:
    @torch.inference_mode()  # the runner's logits are inference tensors: written in place only inside it
    def sample(self, logits: torch.Tensor, batch: SamplingBatch, scratch: bool = False) -> SamplerOutput:
        """logits: [N, V] fp32, one row per entry of `batch`. `scratch`: the caller has no more use
        for them, so temperature and truncation may write over them (a large vocabulary's rows
        are not copied each step)."""
        assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[0] == len(batch.params)
        params = batch.params
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        processed = process_logits(logits, batch)
        tokens = _pick(processed, params, batch.generators, scratch or processed is not logits)
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if logprob_rows:
            sampled = tokens[logprob_rows]
            num_top = [params[i].logprobs for i in logprob_rows]
            for i, row_logprobs in zip(logprob_rows, token_logprobs(raw_logprobs, sampled, num_top)):
                logprobs[i] = row_logprobs
        return SamplerOutput(tokens.tolist(), logprobs)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, the min_tokens mask and the penalties; a new tensor, or `logits` itself when none apply."""
    params, token_ids = batch.params, batch.token_ids
    output_ids = [ids[n:] for ids, n in zip(token_ids, batch.num_prompt_tokens)]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    masked = [
        (i, t)
        for i, p in enumerate(params)
        if len(output_ids[i]) < p.min_tokens
        for t in batch.stop_ids[i]
    ]
    masked += [(i, t) for i, p in enumerate(params) if p.bad_words_token_ids
               for t in _bad_word_ends(p.bad_words_token_ids, output_ids[i])]
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    count_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not (bias or masked or allowed_rows or rep_rows or count_rows):
        return logits
    logits = logits.clone()
    if bias:
        rows, cols, values = zip(*bias)
        values = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(_index(rows, cols, logits.device), values, accumulate=True)
    if allowed_rows:
        outside = torch.ones(len(allowed_rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        rows, cols = zip(*((r, t) for r, i in enumerate(allowed_rows) for t in params[i].allowed_token_ids))
        outside[_index(rows, cols, logits.device)] = False
        logits[allowed_rows] = logits[allowed_rows].masked_fill(outside, float("-inf"))
    if masked:
        rows, cols = zip(*masked)
        logits.index_put_(_index(rows, cols, logits.device), torch.tensor(float("-inf"), device=logits.device))
    # The penalties touch only the tokens a row has seen, so they work on those (row, token)
    # pairs alone, not on the whole vocabulary of every row.
    if rep_rows:
        rows, cols, entries, _ = _occurrences(rep_rows, [token_ids[i] for i in rep_rows], logits)
        penalty = _values([params[i].repetition_penalty for i in rep_rows], logits)[entries]
        seen = logits[rows, cols]
        logits[rows, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if count_rows:
        rows, cols, entries, counts = _occurrences(count_rows, [output_ids[i] for i in count_rows], logits)
        frequency = _values([params[i].frequency_penalty for i in count_rows], logits)[entries]
        presence = _values([params[i].presence_penalty for i in count_rows], logits)[entries]
        logits[rows, cols] -= frequency * counts + presence
    return logits


NUCLEUS_CANDIDATES = (256, 4096)  # the largest logits top-p looks among, in turn; a wider nucleus is sorted


def truncate(logits: torch.Tensor, params: list[SamplingParams], in_place: bool = False) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf, for random rows only (no greedy row here);
    on `logits` themselves where `in_place`, else on a copy (none when nothing changes them).

    Top-k keeps values >= the k-th largest (ties all survive); top-p, over what top-k kept, keeps
    a token when the probability of the tokens above it is still below p (so never drops the
    highest); min-p drops tokens less likely than min_p times the highest, i.e. logits below
    max + log(min_p). Each is a threshold on the row, so no row is sorted whole unless its
    nucleus is wide: the largest NUCLEUS_CANDIDATES[0] values (at least the largest top_k) are
    taken, the nucleus is looked for among them, its probabilities against the whole row's sum,
    then among more for the rows whose nucleus reached past them, and a row whose nucleus is
    wider still is truncated by sorting it (`truncate_sorted`, the reference).
    """
    assert not any(p.greedy for p in params)
    untruncated = all(p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params)
    if any(p.temperature != 1.0 for p in params):
        temperature = _column([p.temperature for p in params], logits)
        logits = logits.div_(temperature) if in_place else logits / temperature
    elif not (in_place or untruncated):
        logits = logits.clone()  # masked in place below
    if untruncated:
        return logits
    vocab_size = logits.shape[1]
    if all(p.top_k == 0 and p.top_p == 1.0 for p in params):  # min-p alone: the row's maximum is enough
        return logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) +
                                   _column([p.min_p for p in params], logits).log(), float("-inf"))
    largest = logits.topk(min(vocab_size, max(NUCLEUS_CANDIDATES[0], *(p.top_k for p in params))), dim=-1).values
    # top-k's threshold (k = 0, off: -inf keeps the whole row); top-p weighs what it keeps
    kth = torch.tensor([min(p.top_k, vocab_size) - 1 if p.top_k else 0 for p in params], device=logits.device)
    top_k = largest.gather(1, kth.unsqueeze(1))
    top_k[[i for i, p in enumerate(params) if not p.top_k]] = float("-inf")
    # and min-p's, from the row's maximum
    threshold = torch.maximum(top_k, largest[:, :1] + _column([p.min_p for p in params], logits).log())
    wide = [i for i, p in enumerate(params) if p.top_p < 1.0]  # rows whose nucleus is not found yet
    wider = None
    if wide:
        # what top-k kept of those rows, and the log of its sum: top-p's probabilities
        kept = logits[wide]
        if any(params[i].top_k for i in wide):
            kept.masked_fill_(kept < top_k[wide], float("-inf"))
        log_sum = kept.logsumexp(dim=-1, keepdim=True)
        for size in NUCLEUS_CANDIDATES:
            top = largest[wide].masked_fill(largest[wide] < top_k[wide], float("-inf")) \
                if size <= largest.shape[1] else kept.topk(min(vocab_size, size), dim=-1).values
            nucleus, found = _nucleus(top, log_sum, [params[i].top_p for i in wide])
            threshold[wide] = torch.where(found, torch.maximum(threshold[wide], nucleus), threshold[wide])
            narrow = ~found.squeeze(1)
            wide = [i for i, outside in zip(wide, narrow.tolist()) if outside]
            kept, log_sum = kept[narrow], log_sum[narrow]
            if not wide:
                break
        if wide:
            wider = truncate_sorted(logits[wide], [params[i] for i in wide])  # before any mask
    logits.masked_fill_(logits < threshold, float("-inf"))
    if wider is not None:
        logits[wide] = wider
    return logits


def _nucleus(top: torch.Tensor, log_sum: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's threshold for rows whose largest values (after top-k, descending) are `top` and
    whose kept values' log-sum-exp is `log_sum`: the value of the last token kept, the one whose
    tokens above hold less than p of the row; and whether that token is among `top` ([R, 1] each)."""
    # the probability of the first j + 1 values, at j: position j + 1 is kept while it is below p
    under_p = ((top - log_sum).exp_().cumsum_(dim=-1) < _column(top_p, top)).sum(dim=-1, keepdim=True)
    return top.gather(1, under_p.clamp_max(top.shape[1] - 1)), under_p < top.shape[1]


def truncate_sorted(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p (as truncate) on tempered logits, each row sorted whole, ascending
    (vLLM's layout): top-p drops the low tokens whose cumulative probability stays <= 1 - p.
    truncate's fallback for a wide nucleus, and its reference in the tests."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)
    # k = 0 (off) keeps the whole row: its threshold is the row's smallest value.
    kth = [vocab_size - min(p.top_k, vocab_size) if p.top_k else 0 for p in params]
    drop = sorted_logits < sorted_logits.gather(1, torch.tensor(kth, device=logits.device).unsqueeze(1))
    sorted_logits.masked_fill_(drop, float("-inf"))
    drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - _column([p.top_p for p in params], logits)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    log_min_p = _column([p.min_p for p in params], logits).log()
    sorted_logits.masked_fill_(sorted_logits < sorted_logits[:, -1:] + log_min_p, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def _pick(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
          scratch: bool) -> torch.Tensor:
    """One token per row: argmax for greedy rows, inverse-CDF sampling for the others. `scratch`:
    `logits` may be written over."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return argmax(logits)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        tokens[greedy_rows] = argmax(logits[greedy_rows])
    whole = len(random_rows) == len(params)
    rows = logits if whole else logits[random_rows]  # else a copy, the sampler's own
    truncated = truncate(rows, [params[i] for i in random_rows], in_place=scratch or not whole)
    uniform = torch.rand(len(random_rows), dtype=torch.float64, device=logits.device)
    for row, i in enumerate(random_rows):
        if generators[i] is not None:
            uniform[row] = draw_uniform(generators[i])  # the copy lands it on the logits' device
    tokens[random_rows] = draw_from_softmax(truncated, uniform)
    return tokens


def _compiled(logits: torch.Tensor):
    """trillm/kernels/sampling_cpu, where it runs these logits (fp32 rows on CPU), else None."""
    if logits.device.type != "cpu" or not _SAMPLING_CPU_BUILT or logits.stride(-1) != 1:
        return None
    from trillm.kernels import sampling_cpu

    return sampling_cpu


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row of `logits` [R, V], its largest logit's first token: compiled on CPU, else torch's."""
    compiled = _compiled(logits)
    return compiled.argmax(logits) if compiled is not None else logits.argmax(dim=-1)


def draw_from_softmax(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of `logits` [R, V], the token at uniform[row] of its softmax by inverse CDF:
    compiled on CPU, elsewhere its twin, inverse_cdf."""
    compiled = _compiled(logits)
    if compiled is not None:
        return compiled.sample(logits, uniform.cpu())
    return inverse_cdf(logits.softmax(dim=-1), uniform)


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's number for one sampled position, from its own generator, on the
    generator's device (verification.SeededStreams replays these draws)."""
    return torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [R, V] (rows of non-negative numbers, each with one above 0), the first
    token whose cumulative probability exceeds uniform[row] (in [0, 1)) times the row's total.

    Summed in float64, so a token's share is its probability, where fp32's running sum near 1
    would round away every token below about 3e-8. A token of probability 0 adds nothing, so
    its cumulative equals the one before it and it is never the first to exceed; u * total stays
    below the total (u is a float64 below 1, and rounding the product can reach the total only
    from within half a spacing of it), so some token always does."""
    cdf = probs.double().cumsum_(dim=-1)  # cumsum(dtype=float64) converts far more slowly on CPU
    target = uniform.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: list[int], ranks: bool = False
) -> list[TokenLogprobs]:
    """Per row of `logprobs` [R, V]: the logprob of `tokens[row]`, the row's top `num_top[row]`
    (one topk over the largest n asked, sliced per row) and, with `ranks`, the token's rank."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    rank = (logprobs > chosen).sum(dim=1).add_(1).tolist() if ranks else [None] * len(num_top)
    chosen = chosen.squeeze(1).tolist()
    max_n = max(num_top, default=0)
    if max_n:
        top_values, top_ids = logprobs.topk(max_n, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(chosen[row], list(zip(top_ids[row][:n], top_values[row][:n])) if n else [], rank[row])
        for row, n in enumerate(num_top)
    ]


def _bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last, where the output ends
    with the rest of it (a one-token word, always)."""
    return [w[-1] for w in words if len(w) <= len(output) + 1 and output[len(output) - len(w) + 1:] == w[:-1]]


def _occurrences(row_ids: list[int], tokens: list[list[int]], like: torch.Tensor):
    """The distinct (row, token) pairs of `tokens` (one list per entry of `row_ids`, the logits
    rows they belong to), built with one unique over the flattened ids: each pair's logits row
    and token, the index of its entry in `row_ids`, and how often the token occurs there."""
    vocab_size, device = like.shape[1], like.device
    ids = torch.tensor(list(itertools.chain.from_iterable(tokens)), dtype=torch.long, device=device)
    entry = torch.repeat_interleave(torch.arange(len(tokens), device=device),
                                    torch.tensor([len(t) for t in tokens], device=device))
    keys, counts = torch.unique(entry * vocab_size + ids, return_counts=True)
    entries = keys // vocab_size
    rows = torch.tensor(row_ids, dtype=torch.long, device=device)[entries]
    return rows, keys % vocab_size, entries, counts.to(like.dtype)


def _values(values, like: torch.Tensor) -> torch.Tensor:
    """Per-entry values as a vector of `like`'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _column(values, like: torch.Tensor) -> torch.Tensor:
    """Per-row values as an [R, 1] column that broadcasts against `like`'s rows."""
    return _values(values, like).unsqueeze(1)


def _index(rows, cols, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device)
