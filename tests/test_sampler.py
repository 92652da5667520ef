"""The batched sampler against slow per-row references and its own promises.

Random draws are made deterministic with torch.manual_seed; the frequency checks
use enough draws that their tolerances are several standard errors wide.
"""
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.engine.sampler import Sampler, SamplingBatch, inverse_cdf, process_logits, truncate, truncate_sorted
from trillm.sampling_params import SamplingParams

EOS = 3
VOCAB = 32


def batch_of(params, token_ids=None, num_prompt_tokens=None, generators=None, eos=(EOS,)) -> SamplingBatch:
    """As the engine builds it, for a model whose EOS ids are `eos`."""
    n = len(params)
    token_ids = token_ids if token_ids is not None else [[0]] * n
    num_prompt_tokens = num_prompt_tokens if num_prompt_tokens is not None else [len(t) for t in token_ids]
    generators = generators if generators is not None else [None] * n
    return SamplingBatch(params, token_ids, num_prompt_tokens, generators, [p.stop_token_set(eos) for p in params])


def sample(logits, params, token_ids=None, num_prompt_tokens=None, generators=None, eos=(EOS,)):
    return Sampler().sample(logits, batch_of(params, token_ids, num_prompt_tokens, generators, eos))


def random_logits(n, vocab=VOCAB, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(6)
    out = sample(logits, [SamplingParams(temperature=0)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_are_argmax_among_random_rows():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_k=5 if i == 2 else 0) for i in range(6)]
    out = sample(logits, params)
    for i in (1, 3, 5):
        assert out.token_ids[i] == logits[i].argmax().item()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-9),
        SamplingParams(temperature=1.5, min_p=1.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_narrowest_truncation_is_greedy(params):
    torch.manual_seed(0)
    logits = random_logits(64, seed=1)
    assert sample(logits, [params] * 64).token_ids == logits.argmax(-1).tolist()


def frequencies(tokens, vocab):
    counts = Counter(tokens)
    return torch.tensor([counts[t] / len(tokens) for t in range(vocab)])


def test_random_sampling_follows_the_tempered_distribution():
    torch.manual_seed(0)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    out = sample(row.expand(n, -1).clone(), [SamplingParams(temperature=0.7)] * n, eos=())
    expected = torch.softmax(row / 0.7, -1)
    assert torch.allclose(frequencies(out.token_ids, 5), expected, atol=0.015)


def test_inverse_cdf_picks_only_tokens_with_probability_at_the_edges():
    """u = 0 and u just under 1 land on the first and last tokens that have any probability,
    never on the zeros around them; a probability too small for fp32's running sum still wins
    its share."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0],
                          [1.0, 1e-9, 0.0, 0.0, 0.0, 0.0]])
    cases = [(0.0, [1, 2, 0]), (0.5, [3, 2, 0]), (1 - 2.0 ** -53, [3, 2, 1]), (1 - 2e-9, [3, 2, 0])]
    for u, expected in cases:
        assert inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64)).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([1, 63, 64, 65, 200, 49152]), seed=st.integers(0, 2**16),
       masked=st.sampled_from([0.0, 0.5, 0.99]), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_compiled_draw_matches_its_twin(rows, vocab, seed, masked, scale):
    """The CPU kernel draws the twin's token (inverse_cdf of a softmax) wherever u is not within
    rounding of a boundary between two tokens, and never a masked one."""
    from trillm.kernels import sampling_cpu

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    mask = torch.rand(rows, vocab, generator=g) < masked
    mask[:, torch.randint(vocab, (1,), generator=g)] = False  # every row keeps a token
    logits[mask] = -math.inf
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    uniform[0] = 0.0
    if rows > 1:
        uniform[1] = 1 - 2.0 ** -53
    drawn = sampling_cpu.sample(logits, uniform)
    twin = inverse_cdf(logits.softmax(-1), uniform)
    assert not mask.gather(1, drawn.unsqueeze(1)).any()
    cdf = logits.softmax(-1).double().cumsum(-1)
    for r in torch.nonzero(drawn != twin).flatten().tolist():
        boundary = cdf[r, min(drawn[r], twin[r])]
        assert abs(uniform[r] * cdf[r, -1] - boundary) < 1e-5, (r, drawn[r], twin[r])


def test_compiled_argmax_takes_the_first_of_tied_maxima():
    from trillm.kernels import sampling_cpu

    logits = torch.randn(5, 300)
    logits[1, [7, 250]] = 10.0
    logits[2] = -math.inf
    logits[3, 299] = 10.0
    assert sampling_cpu.argmax(logits).tolist() == logits.argmax(-1).tolist()
    assert sampling_cpu.argmax(logits)[1:4].tolist() == [7, 0, 299]


def test_min_p_drops_unlikely_tokens_and_keeps_the_rest_in_proportion():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    out = sample(probs.log().expand(n, -1).clone(), [SamplingParams(min_p=0.2)] * n, eos=())
    freq = frequencies(out.token_ids, 4)
    assert freq[3] == 0  # 0.05 < 0.2 * 0.5
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.015)


def test_top_k_and_top_p_keep_the_right_tokens_in_proportion():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20000
    logits = probs.log().expand(n, -1).clone()
    freq = frequencies(sample(logits, [SamplingParams(top_k=2)] * n, eos=()).token_ids, 4)
    assert torch.allclose(freq, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=0.015)
    # top_p=0.75: 0.4 + 0.3 < 0.75, so the 0.2 token is needed too; the 0.1 token is not.
    freq = frequencies(sample(logits, [SamplingParams(top_p=0.75)] * n, eos=()).token_ids, 4)
    assert torch.allclose(freq, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]), atol=0.015)


def reference_process(logits, params, token_ids, num_prompt_tokens, eos):
    """Per row, per token, in plain Python: bias, allowed tokens, bad words, min_tokens,
    repetition, frequency, presence."""
    out = logits.clone()
    for i, p in enumerate(params):
        row = out[i].tolist()
        output = token_ids[i][num_prompt_tokens[i]:]
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        if p.allowed_token_ids is not None:
            row = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(row)]
        for word in p.bad_words_token_ids or []:
            *head, last = word
            if not head or (len(output) >= len(head) and output[len(output) - len(head):] == head):
                row[last] = -math.inf
        if len(output) < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {eos}):
                row[t] = -math.inf
        for t in set(token_ids[i]):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t, count in Counter(output).items():
            row[t] -= p.frequency_penalty * count + p.presence_penalty
        out[i] = torch.tensor(row)
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_process_logits_matches_a_per_row_reference(data):
    n = data.draw(st.integers(1, 5))
    params, token_ids, num_prompt_tokens = [], [], []
    for _ in range(n):
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
        output = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
        token_ids.append(prompt + output)
        num_prompt_tokens.append(len(prompt))
        params.append(
            SamplingParams(
                repetition_penalty=data.draw(st.sampled_from([1.0, 0.8, 1.3, 2.0])),
                frequency_penalty=data.draw(st.sampled_from([0.0, -0.5, 0.7, 2.0])),
                presence_penalty=data.draw(st.sampled_from([0.0, 1.0, -2.0])),
                logit_bias=data.draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3)),
                min_tokens=data.draw(st.integers(0, 10)),
                stop_token_ids=data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                ignore_eos=data.draw(st.booleans()),
                max_tokens=None,
                allowed_token_ids=data.draw(st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
                # Words that end the output (drawn from it) as well as random ones.
                bad_words_token_ids=data.draw(st.none() | st.lists(
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)
                    | st.integers(0, 3).map(lambda k, o=output: o[len(o) - k:] + [0]),
                    min_size=1, max_size=3)),
            )
        )
    logits = random_logits(n, seed=data.draw(st.integers(0, 1000)))
    got = process_logits(logits, batch_of(params, token_ids, num_prompt_tokens))
    expected = reference_process(logits, params, token_ids, num_prompt_tokens, EOS)
    assert torch.allclose(got, expected, atol=1e-5, equal_nan=False)
    assert torch.equal(got.isinf(), expected.isinf())


def test_penalties_touch_only_the_tokens_they_concern():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    prompt, output = [0, 1], [2, 2, 3]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, batch_of([params], [prompt + output], [len(prompt)]))
    # 0, 1: prompt only, repetition penalty; 2: divided, then 2 * 0.5 + 0.25 off; 3: multiplied, then 0.75 off.
    assert got.tolist() == [[1.0, -4.0, 1.0 - 1.25, -4.0 - 0.75, 1.0, 1.0]]


def test_logit_bias_forces_and_forbids_tokens():
    logits = random_logits(4)
    forced = [7, 11, 19, 2]
    params = [SamplingParams(temperature=t, logit_bias={f: 100}) for t, f in zip([0, 1.0, 0.5, 2.0], forced)]
    assert sample(logits, params).token_ids == forced
    top = logits[0].argmax().item()
    second = logits[0].topk(2).indices[1].item()
    assert sample(logits[:1], [SamplingParams(temperature=0, logit_bias={top: -100})]).token_ids == [second]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9], logits[0, 5] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    prompt = [1, 1]
    assert sample(logits, [params], [prompt + [4]], [2]).token_ids == [5]  # one output: both masked
    assert sample(logits, [params], [prompt + [4, 4]], [2]).token_ids == [EOS]  # two: free
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [ignoring], [prompt], [2]).token_ids == [EOS]  # EOS is a plain token then


def test_min_tokens_masks_every_eos_id_of_the_model():
    """Llama 3 ends a turn on <|eot_id|> and on <|end_of_text|>: both wait for min_tokens."""
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 7], logits[0, 5] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0, min_tokens=1)
    assert sample(logits, [params], [[1]], [1], eos=(EOS, 7)).token_ids == [5]
    assert sample(logits, [params], [[1, 4]], [1], eos=(EOS, 7)).token_ids == [EOS]


def test_min_tokens_without_an_eos_token_masks_only_stop_token_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9] = 10.0, 11.0
    params = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[9])
    assert sample(logits, [params], [[1]], [1], eos=()).token_ids == [EOS]


def generator_for(params):
    """As the engine does: one generator per seeded request, made at admission."""
    return None if params.seed is None else torch.Generator().manual_seed(params.seed)


def run_steps(params, logits_per_step, position, others):
    """Samples `params` at `position` of a batch with `others` around it, step after step."""
    generator = generator_for(params)
    other_generators = [generator_for(p) for p in others]
    tokens = []
    for step, row in enumerate(logits_per_step):
        batch_params = others[:position] + [params] + others[position:]
        generators = other_generators[:position] + [generator] + other_generators[position:]
        filler = random_logits(len(others), seed=100 + step)
        logits = torch.cat([filler[:position], row.unsqueeze(0), filler[position:]])
        out = sample(logits, batch_params, generators=generators)
        tokens.append(out.token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "params",
    [SamplingParams(seed=7), SamplingParams(seed=7, temperature=0.8, top_p=0.9, top_k=10, min_p=0.05)],
    ids=["plain", "truncated"],
)
def test_seeded_request_gets_the_same_tokens_in_any_batch(params):
    steps = list(random_logits(12, seed=5) / 3)
    alone = run_steps(params, steps, 0, [])
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=3, top_k=4)]
    others.append(SamplingParams(top_p=0.5))
    torch.manual_seed(123)
    assert run_steps(params, steps, 2, others) == alone
    torch.manual_seed(456)
    assert run_steps(params, steps, 4, others[::-1]) == alone
    assert len(set(alone)) > 1  # the noise moves on from step to step


def test_logprobs_are_the_raw_distributions():
    logits = random_logits(4)
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, logit_bias={1: 5.0}),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=0, frequency_penalty=1.0),
        SamplingParams(temperature=0, logprobs=20),
    ]
    out = sample(logits, params, token_ids=[[1, 2, 3]] * 4, num_prompt_tokens=[1] * 4)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i, n in [(0, 3), (2, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp.logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert len(lp.top) == n
        values, ids = raw[i].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_sampled_token_has_its_logprob_even_outside_the_top_n():
    logits = random_logits(1)
    low = logits[0].argmin().item()
    out = sample(logits, [SamplingParams(temperature=0, logprobs=2, logit_bias={low: 100})])
    assert out.token_ids == [low]
    lp = out.logprobs[0]
    assert low not in [t for t, _ in lp.top]
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[low].item(), abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.integers(0, VOCAB + 4),
    top_p=st.floats(0.01, 1.0),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.7]),
)
def test_sampled_tokens_stay_in_the_truncated_support(seed, temperature, top_k, top_p, min_p):
    torch.manual_seed(seed)
    n = 16
    logits = random_logits(n, seed=seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for row, token in zip(logits / temperature, sample(logits, [params] * n, eos=()).token_ids):
        value = row[token]
        if top_k:
            assert (row > value).sum() < top_k
            row = row.masked_fill(row < row.topk(min(top_k, VOCAB)).values[-1], -math.inf)
        probs = row.softmax(-1)
        assert probs[probs > probs[token]].sum() < top_p + 1e-5
        if min_p:
            assert value >= row.max() + math.log(min_p) - 1e-5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5, seed=3),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3),
    SamplingParams(seed=3),
])
def test_the_steps_logits_are_tempered_in_place_and_a_callers_are_kept(params):
    """A large vocabulary's rows are 1 MiB each: the engine's step hands its logits over as
    scratch, and temperature and truncation write over them instead of copying them each step;
    logits a caller keeps are never changed. Either way the same tokens are drawn."""
    logits = random_logits(4, vocab=5000)
    kept = logits.clone()
    batch = [params] * 4
    tokens = Sampler().sample(logits, batch_of(batch, generators=[torch.Generator().manual_seed(3) for _ in batch]))
    assert torch.equal(logits, kept)
    with torch.inference_mode():  # as the runner makes them
        scratch = logits.clone()
    again = Sampler().sample(scratch, batch_of(batch, generators=[torch.Generator().manual_seed(3) for _ in batch]),
                             scratch=True)
    assert again.token_ids == tokens.token_ids
    if params.temperature != 1.0:
        tempered = kept / params.temperature
        assert torch.equal(scratch[torch.isfinite(scratch)], tempered[torch.isfinite(scratch)])
    # Temperature 1 and no truncation change nothing: the rows are drawn from as they are.
    assert truncate(kept, [SamplingParams()] * 4) is kept


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.sampled_from([7, 300, 5000, 20000]),
       scale=st.sampled_from([0.05, 1.0, 8.0]), data=st.data())
def test_truncation_by_thresholds_keeps_what_sorting_keeps(seed, vocab, scale, data):
    """truncate (thresholds from the largest values, the nucleus found among 256 of them, then
    4096, then by sorting) keeps the tokens truncate_sorted keeps, in rows of every nucleus width
    (scale 0.05 is nearly flat: its nucleus passes both candidate sets), but where a token's mass
    above lies within rounding of p."""
    g = torch.Generator().manual_seed(seed)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g) * scale
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.5, 1.0, 1.5])),
                             top_k=data.draw(st.sampled_from([0, 0, 1, 5, 300, vocab + 3])),
                             top_p=data.draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.01])),
                             min_p=data.draw(st.sampled_from([0.0, 0.0, 0.05, 0.5]))) for _ in range(rows)]
    fast, sorted_ = truncate(logits, params), truncate_sorted(logits / torch.tensor(
        [[p.temperature] for p in params]), params)
    for row, p in enumerate(params):
        differ = torch.nonzero(torch.isinf(fast[row]) != torch.isinf(sorted_[row])).flatten()
        if len(differ):
            tempered = logits[row] / p.temperature
            kth = tempered.topk(min(p.top_k, vocab)).values[-1] if p.top_k else -math.inf
            probs = tempered.masked_fill(tempered < kth, -math.inf).softmax(-1)
            for token in differ.tolist():
                above = probs[probs > probs[token]].sum().item()
                assert abs(above - p.top_p) < 1e-4, (row, token, above, p)
