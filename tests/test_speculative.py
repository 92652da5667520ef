"""Speculative decoding: prompt-lookup drafts verified in the batched step. The output must be
exactly what decoding without drafts gives (greedy token for token, seeded sampling too, with
penalties, grammars, stop strings, logprobs and max_tokens), the drafts must actually run (the
acceptance counters move), and the server reports them under vLLM's metric names."""
import json
import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trillm
import trillm.model.runner as runner_module
from trillm import SamplingParams, StructuredOutput
from trillm.engine.draft_policy import PROBE_EVERY, DraftPolicy
from trillm.engine.drafting import NgramDrafter, SpeculativeConfig
from trillm.engine.suffix_drafter import SuffixCache, SuffixDrafter
from trillm.engine.verification import logit_groups

from http_support import live_server, metric_value, settled_stats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "disable_by_batch_size": 8}
# Prompts whose continuations repeat what came before: drafts get accepted.
REPETITIVE = [
    "Copy the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes.\nCopy: apples, pears,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    'def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n',
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
]


def test_the_drafter_proposes_what_followed_the_latest_earlier_ngram():
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    assert drafter.propose(tokens) == [7, 8, 6]  # [2, 3] last occurred before 7 (not before 4)
    tokens += [7, 8]
    assert drafter.propose(tokens) == [6, 2, 3]  # the 3-gram [3, 7, 8] wins over shorter ones
    drafter.accepted(3, 0)
    assert drafter.propose(tokens) == [6]  # nothing kept: one draft next
    drafter.accepted(1, 1)
    assert drafter.propose(tokens) == [6, 2]
    assert drafter.propose(tokens + [42]) == []  # [8, 42] never occurred


def test_suffix_drafts_follow_the_longest_match_and_the_most_frequent_continuation():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_min_token_prob=0.5)
    cache = SuffixCache(max_requests=2, max_tokens=100)
    drafter = SuffixDrafter(config, cache, (0, ""))
    # [5, 6] is followed by 7 twice and by 9 once, but the longer match [4, 5, 6] only by 9.
    tokens = [1, 5, 6, 7, 8, 2, 5, 6, 7, 8, 3, 4, 5, 6, 9, 9, 4, 5, 6]
    assert drafter.propose(tokens) == [9, 9, 4]  # three matched tokens earn three drafts
    two_matched = [1, 5, 6, 7, 8, 2, 5, 6, 7, 8, 3, 5, 6, 9, 0, 5, 6]
    assert SuffixDrafter(config, cache, (0, "")).propose(two_matched) == [7, 8]  # 7 twice in three
    # Another request of the same tenant drafts from a finished one's output; another tenant not.
    drafter.finished([40, 41, 42, 43, 44, 45, 46])
    again = SuffixDrafter(config, cache, (0, ""))
    assert again.propose([7, 40, 41, 42]) == [43, 44, 45]
    assert SuffixDrafter(config, cache, (0, "other-salt")).propose([7, 40, 41, 42]) == []
    assert SuffixDrafter(config, cache, (3, "")).propose([7, 40, 41, 42]) == []
    # The cache keeps the last max_requests outputs: the oldest is forgotten.
    again.finished([50, 51, 52, 53])
    SuffixDrafter(config, cache, (0, "")).finished([60, 61, 62, 63])
    assert SuffixDrafter(config, cache, (0, "")).propose([40, 41, 42]) == []
    assert SuffixDrafter(config, cache, (0, "")).propose([50, 51, 52]) == [53]


def test_suffix_cache_is_bounded_by_tokens_and_forgets_empty_tenants():
    """Outputs go oldest first once their tokens pass the budget, whatever the request count; a
    longer output than the budget keeps its end; a tenant whose outputs are all gone takes no
    room (a salt per user must not grow the cache forever)."""
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    cache = SuffixCache(max_requests=1000, max_tokens=10)
    for salt in ("a", "b", "c"):
        SuffixDrafter(config, cache, (0, salt)).finished([1, 2, 3, 4, 5])
    assert cache.num_tokens == 10 and cache.num_tenants == 2  # "a" went: 15 tokens > 10
    assert SuffixDrafter(config, cache, (0, "a")).propose([1, 2, 3]) == []
    assert SuffixDrafter(config, cache, (0, "c")).propose([1, 2, 3]) == [4, 5]
    SuffixDrafter(config, cache, (0, "d")).finished(list(range(100, 125)))
    assert cache.num_tokens == 10 and cache.num_tenants == 1
    assert SuffixDrafter(config, cache, (0, "d")).propose([115, 116, 117]) == [118, 119, 120]
    assert SuffixDrafter(config, cache, (0, "d")).propose([9, 113, 114]) == []  # its start was cut


@pytest.mark.parametrize(("text", "words"), [
    ('{"method": "eagle"}', "unknown method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"method": "ngram", "draft_model": "x"}', "unknown key 'draft_model'"),
    ('{"method": "ngram", "disable_by_batch_size": -1}', "disable_by_batch_size"),
    ('{"method": "ngram", "disable_by_batch_size": true}', "disable_by_batch_size must be an integer or null"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
    ('["ngram"]', "JSON object"),
    ("{method: ngram}", "not JSON"),
])
def test_the_config_takes_vllm_keys_and_refuses_the_rest(text, words):
    assert SpeculativeConfig.parse(json.dumps(NGRAM)) == SpeculativeConfig(**NGRAM)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse('{"disable_by_batch_size": null}').disable_by_batch_size is None
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(text)


def decisions(policy: DraftPolicy, num_running: int, steps: int, rates: dict[bool, float] | None = None) -> list[bool]:
    """The policy's choice for `steps` steps at a batch of `num_running`, each step then measured
    at the rate `rates` gives its choice (output tokens per second; None: not measured)."""
    chosen = []
    for _ in range(steps):
        drafted = policy.drafts(num_running)
        chosen.append(drafted)
        if rates is not None:
            policy.measured(num_running, drafted, 10, 10 / rates[drafted])
    return chosen


def test_the_policy_drafts_at_a_batch_size_while_drafting_measures_faster_there():
    policy = DraftPolicy()
    # Nothing measured yet: it tries drafting, then (drafting measured) a step without.
    assert decisions(policy, 1, 2, {True: 300.0, False: 200.0}) == [True, False]
    # Drafting was faster at one stream: it drafts, and tries without it once every PROBE_EVERY steps.
    one = decisions(policy, 1, 4 * PROBE_EVERY, {True: 300.0, False: 200.0})
    assert one.count(False) == 4 and one[PROBE_EVERY - 1] is False
    # At 8-15 requests the step is compute-bound and drafting measured slower: it does not draft,
    # and tries it again once every PROBE_EVERY steps. The batch of one is not disturbed by this.
    eight = decisions(policy, 9, 2 + 4 * PROBE_EVERY, {True: 900.0, False: 1000.0})
    assert eight[:2] == [True, False] and eight[2:].count(True) == 4
    assert decisions(policy, 12, PROBE_EVERY - 4) == [False] * (PROBE_EVERY - 4)  # the same group
    assert decisions(policy, 1, 2) == [True, True]
    assert decisions(policy, 16, 2) == [True, True]  # 16-31: a group not measured yet


def test_the_policy_follows_a_change_in_what_drafting_is_worth():
    """The workload starts repeating itself: drafting gets faster at a batch where it was slower,
    and the policy turns to it within a few tries; then back when the drafts stop."""
    policy = DraftPolicy()
    assert decisions(policy, 4, 3 * PROBE_EVERY, {True: 500.0, False: 800.0}).count(True) <= 4
    turned = decisions(policy, 4, 6 * PROBE_EVERY, {True: 1600.0, False: 800.0})
    # within three tries it drafts, and thereafter leaves drafting only to try the other choice
    assert turned[3 * PROBE_EVERY:].count(False) == 3
    back = decisions(policy, 4, 3 * PROBE_EVERY, {True: 400.0, False: 800.0})
    assert back[PROBE_EVERY:].count(True) == 2  # drafting measured slower at once


def test_a_fixed_disable_by_batch_size_is_the_users_rule():
    policy = DraftPolicy(cap=4)
    assert decisions(policy, 4, 3, {True: 1.0, False: 1000.0}) == [True] * 3  # measured, not heeded
    assert decisions(policy, 5, 3) == [False] * 3
    assert decisions(DraftPolicy(cap=0), 512, 3) == [True] * 3


@pytest.fixture(scope="module")
def engines():
    """The default model as `trillm serve` runs it (its GGUF blocks, decode steps on the fused
    stack), without drafts and with them."""
    plain = trillm.LLM(num_kv_blocks=256, speculative_config="")
    drafting = trillm.LLM(num_kv_blocks=256, speculative_config=json.dumps(NGRAM))
    yield plain, drafting
    # Their grammar compiler processes stop now, not whenever the engines are collected (a later
    # module on this worker counts its processes).
    plain.engine.close()
    drafting.engine.close()


def outputs(llm, prompts, params):
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def test_greedy_with_drafts_is_greedy_without_them(engines):
    plain, drafting = engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    before = drafting.engine.stats()
    expected = outputs(plain, REPETITIVE, params)
    got = outputs(drafting, REPETITIVE, params)
    stats = drafting.engine.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    for g, e in zip(got, expected):  # every emitted token has its logprobs, the same numbers
        assert len(g.logprobs) == len(g.token_ids) == 48
        assert [lp.top[0][0] for lp in g.logprobs] == [lp.top[0][0] for lp in e.logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, e.logprobs)) < 0.05
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert accepted > 48 and drafted >= accepted  # the drafts ran, and most of a copy was free
    assert sum(stats.spec_decode_accepted_per_position) == stats.spec_decode_num_accepted_tokens
    assert stats.num_used_blocks == 0


def test_the_default_drafts_where_it_measured_and_stays_exact(engines):
    """The server's default config gives no disable_by_batch_size: the engine measures its decode
    steps at each batch size with drafts and without, and the output is greedy's either way."""
    plain, _ = engines
    measured = trillm.LLM(num_kv_blocks=256)
    try:
        policy = measured.engine.draft_policy
        assert measured.engine.speculative.disable_by_batch_size is None and policy.cap is None
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        assert [o.token_ids for o in outputs(measured, REPETITIVE, params)] == \
            [o.token_ids for o in outputs(plain, REPETITIVE, params)]
        rates = policy.groups[DraftPolicy.group(len(REPETITIVE))]
        assert rates.drafting > 0 and rates.plain > 0  # both measured at a batch of four
        assert measured.engine.stats().spec_decode_num_drafts > 0
    finally:
        measured.engine.close()


def test_suffix_drafts_are_exact_and_learn_from_earlier_outputs(engines):
    plain, _ = engines
    suffix = trillm.LLM(num_kv_blocks=256, speculative_config=json.dumps(
        {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 8}))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = "Write ten short, different sentences about the weather in spring."  # free text: few repeats
    expected = outputs(plain, [prompt], params)[0].token_ids
    first = outputs(suffix, [prompt], params)[0].token_ids
    accepted_first = suffix.engine.stats().spec_decode_num_accepted_tokens
    again = outputs(suffix, [prompt], params)[0].token_ids  # its answer is now in the cache
    accepted_again = suffix.engine.stats().spec_decode_num_accepted_tokens - accepted_first
    assert first == again == expected
    assert accepted_again > accepted_first and accepted_again >= 30
    assert [o.token_ids for o in outputs(suffix, REPETITIVE[:2], params)] == \
        [o.token_ids for o in outputs(plain, REPETITIVE[:2], params)]
    assert suffix.engine.stats().num_used_blocks == 0


def test_seeded_sampling_with_penalties_is_the_same_with_drafts(engines):
    plain, drafting = engines
    before = drafting.engine.stats().spec_decode_num_drafts
    prompts = REPETITIVE[:2] * 2
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=seed, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.05, frequency_penalty=0.1) for seed in (0, 0, 1, 1)]
    assert [o.token_ids for o in outputs(drafting, prompts, params)] == \
        [o.token_ids for o in outputs(plain, prompts, params)]
    assert drafting.engine.stats().spec_decode_num_drafts > before


def test_stops_max_tokens_and_grammars_hold_inside_accepted_runs(engines):
    plain, drafting = engines
    prompt = REPETITIVE[1]
    full = outputs(plain, [prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=["8,"]),
                   SamplingParams(temperature=0, max_tokens=13),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[9]]),
                   SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[full.token_ids[9]])):
        got, expected = outputs(drafting, [prompt], params)[0], outputs(plain, [prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason)
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
              "required": ["fruits"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    prompt = ('Fruits: apples, pears, plums. As JSON: {"fruits": ["apples", "pears", "plums"]}\n'
              'Fruits: apples, pears, plums. As JSON:')
    accepted = drafting.engine.stats().spec_decode_num_accepted_tokens
    got, expected = outputs(drafting, [prompt], params)[0], outputs(plain, [prompt], params)[0]
    assert got.token_ids == expected.token_ids and got.finish_reason == "stop"
    assert json.loads(got.text) == {"fruits": ["apples", "pears", "plums"]}
    assert drafting.engine.stats().spec_decode_num_accepted_tokens > accepted  # drafts ran through the grammar
    assert drafting.engine.stats().num_used_blocks == 0


@given(st.lists(st.integers(1, 9), max_size=40), st.one_of(st.none(), st.integers(1, 24)))
def test_logit_groups_are_the_fewest_runs_of_requests_within_the_limit(num_rows, limit):
    groups = logit_groups(num_rows, limit)
    assert [i for group in groups for i in group] == list(range(len(num_rows)))
    sizes = [sum(num_rows[i] for i in group) for group in groups]
    if limit is None:
        assert len(groups) == (1 if num_rows else 0)
        return
    assert all(size <= limit or len(group) == 1 for size, group in zip(sizes, groups))
    # each group is cut only where the next request's rows would not have fitted
    assert all(size + num_rows[group.stop] > limit for size, group in zip(sizes, groups[:-1]))


def test_a_step_projects_its_sampled_rows_a_few_requests_at_a_time(engines, monkeypatch):
    """Where a step samples more rows than the CPU's logits budget holds (drafts add a row
    each), the requests' rows are projected and sampled a group at a time, never one request's
    rows apart: the same tokens, logprobs and grammar as without drafts, and no call for more
    rows than the budget or one request's run."""
    plain, drafting = engines
    runner = drafting.engine.runner
    monkeypatch.setattr(runner_module, "LOGITS_BYTES", 3 * 4 * runner.config.hf_config.vocab_size)
    assert runner.logits_rows == 3
    calls = []
    step_logits = runner.step_logits

    def recorded(hidden):
        calls.append(hidden.shape[0])
        return step_logits(hidden)

    monkeypatch.setattr(runner, "step_logits", recorded)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 12}
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, seed=3, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_output=StructuredOutput("json_schema", json.dumps(schema))),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    prompts = [REPETITIVE[0], REPETITIVE[1], REPETITIVE[1] + " As JSON: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,",
               REPETITIVE[3]]
    before = drafting.engine.stats().spec_decode_num_accepted_tokens
    got, expected = outputs(drafting, prompts, params), outputs(plain, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [[lp.top for lp in o.logprobs] for o in got[:1]] == [[lp.top for lp in o.logprobs] for o in expected[:1]]
    assert drafting.engine.stats().spec_decode_num_accepted_tokens > before
    assert max(calls) <= 1 + NGRAM["num_speculative_tokens"]  # one request's run at most
    assert max(calls) > 3 and calls.count(1) < len(calls)  # drafts were verified, rows went in groups


async def test_the_server_streams_verified_runs_and_reports_vllm_metrics(engines):
    _, drafting = engines
    async with live_server(drafting.engine) as server:
        client, http = server.openai(), server.http()
        prompt = REPETITIVE[0]
        whole = await client.completions.create(model=server.model, prompt=prompt, max_tokens=40, temperature=0,
                                                logprobs=1, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text and whole.usage.completion_tokens == 40
        assert len(whole.choices[0].logprobs.tokens) == 40
        assert await metric_value(http, "trillm:spec_decode_num_accepted_tokens_total") > 0
        assert await metric_value(http, "trillm:spec_decode_num_drafts_total") > 0
        assert await metric_value(http, "trillm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        assert (await settled_stats(http))["num_used_blocks"] == 0


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for `df` degrees of freedom at the normal quantile z (3.719: a
    1-in-10,000 false alarm), by Wilson and Hilferty's cube-root approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_sampled_output_with_drafts_has_the_target_distribution(tiny_model_dir):
    """Thousands of 3-token samples from a tiny model (vocabulary 256), top-k 4, a logit bias that
    makes the prompt's pattern likely so its drafts are often kept: the triples' counts against
    the exact probabilities computed from the model's own logits (teacher forced, the same
    bias, top-k and temperature), by a chi-square test."""
    path = tiny_model_dir("llama")
    a, b, c = 11, 22, 33
    prompt = [a, b, c] * 8
    bias = {a: 4.0, b: 4.0, c: 4.0}
    llm = trillm.LLM(path, num_kv_blocks=512, max_num_seqs=128,
                     speculative_config=json.dumps({**NGRAM, "prompt_lookup_min": 1, "disable_by_batch_size": 0}))
    runner = llm.engine.runner

    def next_probs(tokens: list[int]) -> dict[int, float]:
        logits = runner.teacher_forced_logits(tokens)[-1].clone()
        for token, value in bias.items():
            logits[token] += value
        top = logits.topk(4)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    exact = {}
    for t1, p1 in next_probs(prompt).items():
        for t2, p2 in next_probs(prompt + [t1]).items():
            for t3, p3 in next_probs(prompt + [t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    num_samples = 4000
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, logit_bias=bias)
    counts = Counter(tuple(out.outputs[0].token_ids) for out in llm.generate([prompt] * num_samples, params))
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > num_samples // 10  # drafts were kept, often
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # and rejected too
    assert set(counts) <= set(exact)
    # Bins expected fewer than 5 times are pooled into one, as the test needs.
    small = [key for key, p in exact.items() if p * num_samples < 5]
    bins = [(counts[key], p * num_samples) for key, p in exact.items() if key not in small]
    bins.append((sum(counts[key] for key in small), sum(exact[key] for key in small) * num_samples))
    statistic = sum((seen - expected) ** 2 / expected for seen, expected in bins if expected > 0)
    assert statistic < chi_square_critical(len(bins) - 1), (statistic, len(bins))


@pytest.mark.cuda
def test_verification_runs_as_decode_rows_on_cuda_graphs(tiny_model_dir):
    """On a device: verification steps are decode steps (the Triton decode attention, CUDA
    graphs of the padded row count), and greedy output is greedy decoding's."""
    prompts = [[11, 22, 33, 44] * 6 + [11, 22], [5, 6, 7] * 9, [9, 8, 7, 6, 5] * 5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for config in (None, json.dumps({**NGRAM, "prompt_lookup_min": 1})):
        llm = trillm.LLM(tiny_model_dir("llama"), device="cuda", dtype="float32", num_kv_blocks=64,
                         max_num_seqs=16, speculative_config=config)
        assert llm.engine.runner.decode_graphs is not None
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
