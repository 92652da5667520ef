"""Scheduler: chunked prefill, budgets, prefix hits, preemption, aborts, finishing.

The unit tests pin the policy on small hand-made cases; the state machines drive
random workloads and check, after every rule, the invariants of docs/design.md
plus an end-to-end one: the KV a scheduled request would read (modelled per
slot as the identity of the exact prefix that wrote it) is always its own.
"""
import random
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from msgspec.msgpack import Encoder

from trillm.engine.kv_events import event_batch
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import FINISHED, RUNNING, WAITING, Request, Scheduler, load_uncompiled
from trillm.sched_ext import allocator as compiled_allocator
from trillm.sched_ext import scheduler as compiled_scheduler
from vllm_kv_events_schema import CacheReplica

ENCODER = Encoder()

BS = 4
EOS = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def step(sched: Scheduler, token: int = 7):
    """One schedule + update, every sampled token `token`."""
    out = sched.schedule()
    finished = sched.update(out, [token] * len(out.scheduled))
    sched.check_invariants()
    return out, finished


def plan(out) -> list[tuple[str, int, int, bool]]:
    return [(e.request.request_id, e.num_new_tokens, e.num_computed_tokens, e.needs_sample) for e in out.scheduled]


def scheduled_ids(out) -> list[str]:
    return [e.request.request_id for e in out.scheduled]


def test_the_extensions_are_compiled():
    assert compiled_scheduler.COMPILED is True and compiled_allocator.COMPILED is True
    allocator, scheduler = load_uncompiled()
    assert allocator.COMPILED is False and scheduler.COMPILED is False
    assert type(scheduler.Scheduler(4).allocator) is allocator.BlockAllocator  # plain all the way down


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    sched = Scheduler(16, BS, max_num_batched_tokens=8)
    sched.add(Request("a", range(1, 20), 2))
    a = sched.get("a")
    out, _ = step(sched)
    assert plan(out) == [("a", 8, 0, False)] and len(a.block_table) == 2
    out, _ = step(sched)
    assert plan(out) == [("a", 8, 8, False)] and len(a.block_table) == 4
    out, _ = step(sched)
    assert plan(out) == [("a", 3, 16, True)] and len(a.block_table) == 5
    assert a.num_output_tokens == 1 and a.num_computed_tokens == 19
    out, finished = step(sched)
    assert plan(out) == [("a", 1, 19, True)] and out.num_decodes == 1
    assert finished == [a] and a.finish_reason == "length"


def test_budget_goes_to_running_requests_first_then_admissions():
    sched = Scheduler(16, BS, max_num_batched_tokens=8)
    for k, rid in enumerate("abc"):
        sched.add(Request(rid, [k + 1] * 6, 5))
    out, _ = step(sched)
    assert plan(out) == [("a", 6, 0, True), ("b", 2, 0, False)] and sched.num_waiting == 1
    out, _ = step(sched)
    assert plan(out) == [("a", 1, 6, True), ("b", 4, 2, True), ("c", 3, 0, False)]
    assert out.num_decodes == 1 and out.total_num_tokens == 8


def test_decodes_come_first_in_the_output():
    sched = Scheduler(16, BS, max_num_batched_tokens=12)
    sched.add(Request("cached", range(1, 9), 1))
    step(sched)
    sched.add(Request("long", range(20, 40), 5))
    sched.add(Request("hit", list(range(1, 9)) + [50], 5))  # 8 of its 9 tokens are cached
    out, _ = step(sched)
    assert plan(out) == [("long", 12, 0, False)]
    out, _ = step(sched)  # scheduled: long's last chunk, then hit's one token
    assert plan(out) == [("hit", 1, 8, True), ("long", 8, 12, True)] and out.num_decodes == 1


def test_max_num_seqs_caps_the_batch():
    sched = Scheduler(16, BS, max_num_seqs=2)
    for rid in "abc":
        sched.add(Request(rid, [1, 2], 5))
    out, _ = step(sched)
    assert scheduled_ids(out) == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)


def test_prefix_cache_hits_skip_full_blocks_but_not_the_last_token():
    sched = Scheduler(16, BS)
    sched.add(Request("a", range(1, 11), 1))  # 2 full blocks + 2 tokens
    step(sched)
    assert sched.get("a") is None
    sched.add(Request("b", list(range(1, 9)) + [42, 43, 44], 1))
    out, _ = step(sched)
    assert plan(out) == [("b", 3, 8, True)]
    assert out.scheduled[0].request.num_cached_tokens == 8
    sched.add(Request("c", range(1, 9), 1))  # exactly a's 2 full blocks
    out, _ = step(sched)
    assert plan(out) == [("c", 4, 4, True)]  # the last token is computed: 1 hit, not 2
    alloc = sched.allocator
    assert (alloc.prefix_cache_queries, alloc.prefix_cache_hits) == (2 + 2 + 1, 0 + 2 + 1)


def test_prefix_caching_disabled_recomputes_everything():
    sched = Scheduler(16, BS, enable_prefix_caching=False)
    sched.add(Request("a", range(1, 11), 1))
    step(sched)
    sched.add(Request("b", range(1, 11), 1))
    out, _ = step(sched)
    assert plan(out) == [("b", 10, 0, True)] and out.scheduled[0].request.num_cached_tokens == 0
    assert sched.allocator.prefix_cache_queries == 0


def test_a_burst_sharing_a_prefix_then_follow_ups_hit_every_full_block():
    """Requests sharing a system prompt compute it in the same step; each conversation's next
    turn must then hit every full block computed for it, the shared ones and its own."""
    sched = Scheduler(64, BS, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    system = [2, 3, 4, 5, 2, 3, 4, 5]
    first = [Request(f"r{k}", system + [10 + k] * 5, 3) for k in range(3)]
    for r in first:
        sched.add(r)
    out, _ = step(sched)
    assert scheduled_ids(out) == ["r0", "r1", "r2"]  # one step: the burst
    while sched.has_unfinished():
        step(sched)
    assert [r.num_cached_tokens for r in first] == [0, 0, 0]
    for k, r in enumerate(first):
        follow_up = Request(f"f{k}", r.token_ids + [20 + k] * 4, 2)
        sched.add(follow_up)
        step(sched)
        assert follow_up.num_cached_tokens == (len(r.token_ids) - 1) // BS * BS == 12
        while sched.has_unfinished():
            step(sched)


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = Scheduler(4, BS)
    sched.add(Request("a", [1, 1, 1, 1], 2))
    sched.add(Request("b", [2, 2, 2, 2], 5))
    sched.add(Request("c", [3, 3, 3, 3], 5))
    step(sched)  # a, b, c: one block each, one block left
    sched.add(Request("d", [4, 4, 4, 4], 5))
    out, finished = step(sched)  # all three need a second block
    c = sched.get("c")
    assert out.preempted == ["c"] and scheduled_ids(out) == ["a", "b"]
    assert (c.status, c.num_computed_tokens, c.block_table, c.num_preemptions) == (WAITING, 0, [], 1)
    assert c.token_ids == [3, 3, 3, 3, 7]  # its output is kept and recomputed
    assert [r.request_id for r in finished] == ["a"]
    out, _ = step(sched)
    assert plan(out) == [("b", 1, 5, True), ("c", 5, 0, True)]  # c before d
    assert sched.get("d").status == WAITING


def test_the_newest_request_preempts_itself():
    sched = Scheduler(3, BS)
    sched.add(Request("a", [1, 1, 1, 1], 5))
    sched.add(Request("b", [2, 2, 2, 2], 5))
    step(sched)
    out, _ = step(sched)
    assert out.preempted == ["b"] and scheduled_ids(out) == ["a"]
    assert sched.get("b").status == WAITING and sched.get("a").status == RUNNING


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched = Scheduler(3, BS, max_num_batched_tokens=5, enable_prefix_caching=False)
    sched.add(Request("a", [1, 1, 1], 9))
    sched.add(Request("c", [2] * 8, 9))
    out, _ = step(sched)
    assert plan(out) == [("a", 3, 0, True), ("c", 2, 0, False)]
    out, _ = step(sched)
    assert plan(out) == [("a", 1, 3, True), ("c", 4, 2, False)]
    out, _ = step(sched)  # a needs a block: c goes; its first chunk would fit again, yet waits
    assert out.preempted == ["c"] and plan(out) == [("a", 1, 4, True)]
    out, _ = step(sched)
    assert plan(out) == [("a", 1, 5, True), ("c", 4, 0, False)]


def test_abort_frees_blocks_at_once():
    sched = Scheduler(8, BS)
    sched.add(Request("a", range(1, 10), 5))
    sched.add(Request("w", range(1, 10), 5))
    sched.add(Request("x", range(1, 10), 5))
    sched.check_invariants()
    out = sched.schedule()
    free_before = sched.allocator.num_free_blocks
    a = sched.abort("a", reason="stop")
    assert (a.status, a.finish_reason, a.block_table) == (FINISHED, "stop", [])
    assert sched.allocator.num_free_blocks == free_before + 3
    finished = sched.update(out, [7, 7])  # "a" was aborted after schedule(): skipped
    assert finished == [] and sched.get("a") is None
    assert sched.abort("a") is None and sched.abort("unknown") is None
    sched.check_invariants()
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    assert sched.abort("w").finish_reason == "abort" and sched.num_running == 0
    sched.add(Request("y", [1], 5))
    assert sched.num_waiting == 2 and sched.abort("y").status == FINISHED and sched.num_waiting == 1
    sched.check_invariants()


def run_to_end(sched: Scheduler, tokens: list[int]) -> Request:
    """Feed `tokens` one per step to a lone request until it finishes."""
    for token in tokens:
        _, finished = step(sched, token)
        if finished:
            return finished[0]
    raise AssertionError("the request did not finish")


def test_eos_finishes_with_stop():
    sched = Scheduler(8, BS)
    sched.add(Request("a", [1, 2], 10, stop_token_ids=[EOS]))
    a = run_to_end(sched, [5, 6, EOS, 5])
    assert (a.finish_reason, a.stop_token_id, a.token_ids) == ("stop", EOS, [1, 2, 5, 6, EOS])


def test_ignore_eos_runs_to_max_tokens():
    """The engine's stop set leaves the EOS ids out under ignore_eos; nothing else stops it."""
    sched = Scheduler(8, BS)
    sched.add(Request("a", [1, 2], 3, stop_token_ids=SamplingParams(ignore_eos=True).stop_token_set([EOS])))
    a = run_to_end(sched, [EOS] * 5)
    assert (a.finish_reason, a.stop_token_id, a.num_output_tokens) == ("length", -1, 3)


def test_stop_token_ids_finish_with_stop():
    sched = Scheduler(8, BS)
    sched.add(Request("a", [1, 2], 10, stop_token_ids=[EOS, 8, 9]))
    a = run_to_end(sched, [5, 9, 5])
    assert (a.finish_reason, a.stop_token_id, a.num_output_tokens) == ("stop", 9, 2)


def test_a_stop_token_wins_over_max_tokens():
    sched = Scheduler(8, BS)
    sched.add(Request("a", [1, 2], 1, stop_token_ids=[EOS]))
    assert run_to_end(sched, [EOS]).finish_reason == "stop"


def test_min_tokens_defers_eos_and_stop_tokens():
    sched = Scheduler(8, BS)
    sched.add(Request("a", [1, 2], 10, min_tokens=2, stop_token_ids=[EOS, 9]))
    a = run_to_end(sched, [EOS, 9, EOS])
    assert (a.finish_reason, a.token_ids) == ("stop", [1, 2, EOS, 9, EOS])


def test_max_model_len_finishes_with_length():
    sched = Scheduler(8, BS, max_model_len=8)
    sched.add(Request("a", range(1, 7), 100))
    a = run_to_end(sched, [5] * 5)
    assert (a.finish_reason, len(a.token_ids)) == ("length", 8)


def test_outgrowing_the_whole_pool_finishes_with_length():
    sched = Scheduler(2, BS, max_model_len=100)
    sched.add(Request("a", range(1, 7), 100))
    a = run_to_end(sched, [5] * 5)
    assert (a.finish_reason, len(a.token_ids)) == ("length", 2 * BS + 1)  # its last token is never computed


def test_prompts_that_can_never_fit_are_refused():
    sched = Scheduler(4, BS, max_model_len=12)
    with pytest.raises(ValueError, match="context length"):
        sched.add(Request("a", range(12), 5))
    sched.add(Request("b", range(11), 5))
    sched = Scheduler(3, BS, max_model_len=100)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(Request("c", range(12), 5))  # 12 prompt tokens + 1 need 4 blocks
    sched.add(Request("d", range(11), 5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Request("d", [1], 5))
    done = sched.abort("d")
    with pytest.raises(ValueError, match="already been scheduled"):
        sched.add(done)
    with pytest.raises(ValueError, match="empty"):
        Request("e", [], 5)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("e", [1], -1)


def test_a_prefill_only_request_computes_its_prompt_and_samples_nothing():
    sched = Scheduler(16, BS, max_num_batched_tokens=6)
    sched.add(Request("a", range(1, 11), 0))
    out, finished = step(sched)
    assert plan(out) == [("a", 6, 0, False)] and not finished
    out, finished = step(sched)
    assert plan(out) == [("a", 4, 6, False)]
    a = finished[0]
    assert (a.request_id, a.finish_reason, a.token_ids, a.block_table) == ("a", "length", list(range(1, 11)), [])
    assert sched.allocator.num_used_blocks == 0 and sched.allocator.num_cached_blocks == 10 // BS  # full blocks


def test_priority_policy_admits_the_best_ranked_first():
    sched = Scheduler(64, BS, max_num_batched_tokens=64, max_num_seqs=2, policy="priority")
    for rid, priority in (("low", 5), ("mid", 1), ("high", -3), ("mid2", 1)):
        sched.add(Request(rid, [1, 2, 3], 4, priority=priority))
    out, _ = step(sched)
    assert scheduled_ids(out) == ["high", "mid"]  # then mid2 (same priority, later), then low
    fcfs = Scheduler(64, BS, max_num_batched_tokens=64, max_num_seqs=2)
    for rid, priority in (("low", 5), ("high", -3)):
        fcfs.add(Request(rid, [1, 2, 3], 4, priority=priority))
    assert scheduled_ids(step(fcfs)[0]) == ["low", "high"]  # fcfs ignores priority


def test_priority_policy_preempts_the_worst_ranked_for_a_better_arrival():
    sched = Scheduler(4, BS, max_num_batched_tokens=64, max_num_seqs=4, policy="priority")
    sched.add(Request("low", list(range(1, 2 * BS)), 20, priority=2))
    sched.add(Request("mid", list(range(1, BS)), 20, priority=1))
    step(sched)
    assert sched.num_running == 2 and sched.allocator.num_free_blocks == 1
    sched.add(Request("high", [9] * (2 * BS - 1), 20, priority=0))  # needs 2 blocks
    out, _ = step(sched)
    assert out.preempted == ["low"]  # the worst ranked goes, not the newest
    assert scheduled_ids(out) == ["mid", "high"]
    assert sched.get("low").status == WAITING
    # out of blocks while decoding, the worst running request is preempted first, whatever its age
    sched2 = Scheduler(3, BS, max_num_batched_tokens=64, policy="priority")
    sched2.add(Request("old-low", [1] * (BS - 1), 20, priority=9))
    sched2.add(Request("new-high", [2] * (BS - 1), 20, priority=0))
    preempted = []
    for _ in range(2 * BS):
        preempted += step(sched2)[0].preempted
    assert preempted and set(preempted) == {"old-low"}


def test_requests_share_cached_blocks_only_under_the_same_cache_salt():
    sched = Scheduler(32, BS)
    prompt = list(range(1, 3 * BS + 2))
    sched.add(Request("a", prompt, 1, cache_salt="tenant-a"))
    run_to_end(sched, [5])
    for rid, salt, hit_blocks in (("b", "tenant-b", 0), ("plain", "", 0), ("a2", "tenant-a", 3), ("b2", "tenant-b", 3)):
        sched.add(Request(rid, prompt, 1, cache_salt=salt))
        assert run_to_end(sched, [5]).num_cached_tokens == hit_blocks * BS, rid
    sched.check_invariants()


def test_a_prefix_hit_limit_caps_the_cached_blocks_a_request_takes():
    sched = Scheduler(16, BS)
    sched.add(Request("a", range(1, 3 * BS + 2), 1))
    run_to_end(sched, [5])
    for limit, hit_blocks in ((-1, 3), (0, 0), (BS - 1, 0), (2 * BS + 3, 2)):
        rid = f"limit{limit}"
        sched.add(Request(rid, range(1, 3 * BS + 2), 1, prefix_hit_limit=limit))
        out = sched.schedule()
        assert plan(out) == [(rid, 3 * BS + 1 - hit_blocks * BS, hit_blocks * BS, True)]
        finished = sched.update(out, [5])
        assert finished[0].num_cached_tokens == hit_blocks * BS
        sched.check_invariants()


def trace(module, seed: int, policy: str = "fcfs") -> list:
    """Everything observable of a random workload, run on `module`'s Scheduler."""
    rng = random.Random(seed)
    sched = module.Scheduler(12, BS, max_num_batched_tokens=10, max_num_seqs=3, max_model_len=30, policy=policy)
    prefix = [rng.randrange(1, 6) for _ in range(9)]
    events = []
    for i in range(60):
        if rng.random() < 0.3:
            prompt = prefix[:rng.randrange(10)] + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 8))]
            max_tokens = rng.randrange(12)
            sched.add(module.Request(f"r{i}", prompt, max_tokens, stop_token_ids=[EOS],
                                     min_tokens=min(rng.randrange(3), max_tokens),
                                     prefix_hit_limit=rng.choice([-1, -1, 0, BS]), priority=rng.randrange(-1, 2)))
        out = sched.schedule()
        events.append((plan(out), out.num_decodes, out.preempted, [list(e.request.block_table) for e in out.scheduled]))
        finished = sched.update(out, [rng.randrange(6) for _ in out.scheduled])
        events.append([(r.request_id, r.finish_reason, r.token_ids, r.num_cached_tokens) for r in finished])
    alloc = sched.allocator
    events.append((alloc.num_free_blocks, alloc.num_cached_blocks, alloc.prefix_cache_hits))
    return events


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_and_plain_python_agree(seed, policy):
    _, uncompiled = load_uncompiled()
    assert trace(compiled_scheduler, seed, policy) == trace(uncompiled, seed, policy)


# --- stateful tests -------------------------------------------------------------------

VOCAB = 6  # token 0 is EOS: random samples end requests now and then
PREFIXES = [(), (2, 3, 4, 5, 2), (2, 3, 4, 5, 2, 4, 4, 3, 5), (5, 5, 4, 3, 2, 2, 3, 4)]


def scheduler_machine(num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                      enable_prefix_caching: bool = True, check_hit_rates: bool = False, policy: str = "fcfs",
                      max_loras: int = 0, max_prefill_pairs: int = 0, drafts: bool = False, hash_algo: str = "builtin"):
    """A state machine class driving one scheduler configuration. `check_hit_rates` (for a pool
    too large to evict from): a follow-up turn must hit at least every full block computed for
    the conversation it extends. `max_loras`: requests name LoRA adapters 0-3 (0: none), and the
    running ones use at most that many. `drafts`: decoding requests get random speculative
    drafts, of which verification keeps a random prefix (a rejected draft's KV must never be
    read, by its request or through the prefix cache)."""

    class SchedulerMachine(RuleBasedStateMachine):
        preemptions = 0  # over all runs of this class
        prefix_hits = 0
        max_adapters = 0  # the most LoRA adapters that ran at once
        max_pairs = 0  # the most attention pairs one step's prompt chunks took
        accepted_drafts = 0  # drafts kept, over all runs
        rejected_drafts = 0

        def __init__(self):
            super().__init__()
            self.sched = Scheduler(num_blocks, BS, max_num_batched_tokens, max_num_seqs, max_model_len,
                                   enable_prefix_caching, policy, max_loras, max_prefill_pairs, record_kv_events=True,
                                   hash_algo=hash_algo)
            self.replica = CacheReplica()  # the prefix cache as KV-cache events describe it
            self.max_len = min(max_model_len, num_blocks * BS + 1)
            self.live: set[str] = set()
            self.done: set[str] = set()
            self.expected: dict[str, list[int]] = {}  # token ids each request must have
            self.prefix_ids: dict[tuple[int, int], int] = {}  # (prefix id, token) -> prefix id
            self.kv: dict[int, int] = {}  # slot -> id of the exact prefix whose KV it holds
            self.count = 0
            self.computed_blocks: dict[str, int] = {}  # ended request -> full blocks it computed
            self.min_hits: dict[str, int] = {}  # follow-up -> blocks its first admission must hit
            self.sched_salts: dict[str, str] = {}  # request -> its cache salt
            self.drafted: dict[str, list[int]] = {}  # request -> the drafts it was given last

        def prefix_chain(self, token_ids: list[int], salt: str = "") -> list[int]:
            """Per position, an id of the exact prefix ending there, under a cache salt: KV of one
            salt is foreign to every other."""
            chain, pid = [], self.prefix_ids.setdefault(("salt", salt), len(self.prefix_ids)) if salt else -1
            for token in token_ids:
                pid = self.prefix_ids.setdefault((pid, token), len(self.prefix_ids))
                chain.append(pid)
            return chain

        @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=3 * BS),
              max_tokens=st.integers(0, 24), min_tokens=st.integers(0, 3), ignore_eos=st.booleans(),
              stop_token_ids=st.sampled_from([(), (1,)]), prefix_hit_limit=st.sampled_from([-1, -1, 0, 5, 2 * BS]),
              cache_salt=st.sampled_from(["", "", "a", "b"]), priority=st.integers(-2, 2),
              lora_id=st.sampled_from([0, 0, 1, 2, 3]))
        def add(self, prefix, suffix, max_tokens, min_tokens, ignore_eos, stop_token_ids, prefix_hit_limit, cache_salt,
                priority, lora_id):
            self.add_request(list(prefix) + suffix, max_tokens, min(min_tokens, max_tokens), ignore_eos,
                             stop_token_ids, prefix_hit_limit, cache_salt, priority, lora_id if max_loras else 0)

        @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=2 * BS),
              copies=st.integers(2, 3), max_tokens=st.integers(1, 8))
        def burst(self, prefix, suffix, copies, max_tokens):
            """Requests with one prompt, added together: they compute it in the same steps."""
            for _ in range(copies):
                self.add_request(list(prefix) + suffix, max_tokens, 0, True, ())

        @precondition(lambda self: self.done)
        @rule(data=st.data(), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=2 * BS),
              max_tokens=st.integers(1, 8))
        def follow_up(self, data, suffix, max_tokens):
            """The next turn of an ended conversation: its tokens, then more."""
            previous = data.draw(st.sampled_from(sorted(self.done)))
            # The next turn of a tenant's conversation carries the tenant's salt.
            rid = self.add_request(self.expected[previous] + suffix, max_tokens, 0, True, (),
                                   cache_salt=self.sched_salts.get(previous, ""))
            if rid is not None and check_hit_rates and previous in self.computed_blocks:
                # A prefill-only turn computed its last token too, which a follow-up never takes.
                self.min_hits[rid] = min(self.computed_blocks[previous], (len(self.expected[rid]) - 1) // BS)

        def add_request(self, prompt, max_tokens, min_tokens, ignore_eos, stop_token_ids,
                        prefix_hit_limit=-1, cache_salt="", priority=0, lora_id=0) -> str | None:
            """Add a request, or check that it is refused; its id if it was added."""
            rid = f"r{self.count}"
            self.count += 1
            if not prompt:
                with pytest.raises(ValueError):
                    Request(rid, prompt, max_tokens)
                return None
            # The stop set as the engine makes it: the EOS id unless ignore_eos (SamplingParams.stop_token_set).
            stops = SamplingParams(ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids)).stop_token_set([EOS])
            request = Request(rid, prompt, max_tokens, min_tokens=min_tokens, stop_token_ids=stops,
                              prefix_hit_limit=prefix_hit_limit,
                              cache_salt=cache_salt, priority=priority, lora_id=lora_id)
            if len(prompt) >= max_model_len or cdiv(len(prompt) + 1, BS) > num_blocks:
                with pytest.raises(ValueError):
                    self.sched.add(request)
                return None
            self.sched.add(request)
            self.sched_salts[rid] = cache_salt
            self.live.add(rid)
            self.expected[rid] = list(prompt)
            return rid

        def end(self, r: Request) -> None:
            self.live.remove(r.request_id)
            self.done.add(r.request_id)
            self.computed_blocks[r.request_id] = r.num_computed_tokens // BS

        @rule(seed=st.integers(0, 2**32 - 1))
        def step(self, seed):
            sched = self.sched
            rng = random.Random(seed)
            for rid in sorted(self.live) if drafts else ():
                r = sched.get(rid)
                if r.status == RUNNING and r.num_computed_tokens == len(r.token_ids) - 1 and rng.random() < 0.7:
                    r.draft_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
                    # Drafts not taken (the request was not scheduled) stay for a later step.
                    self.drafted[rid] = list(r.draft_token_ids)
            was_waiting = {rid for rid in self.live if sched.get(rid).status == WAITING}
            out = sched.schedule()
            assert out.total_num_tokens == sum(e.num_new_tokens for e in out.scheduled) <= max_num_batched_tokens
            assert len(out.scheduled) <= max_num_seqs
            ids = scheduled_ids(out)
            assert len(set(ids)) == len(ids) and set(ids) <= self.live
            assert all(e.num_new_tokens == 1 for e in out.scheduled[:out.num_decodes])
            assert all(e.num_new_tokens > 1 for e in out.scheduled[out.num_decodes:])
            # In a step where a running request decodes, prompt chunks stay within the attention
            # budget, but for the one-token minimum of a step's only prompt chunk.
            chunks = [(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled
                      if len(e.request.token_ids) - e.num_computed_tokens > 1]
            if any(len(e.request.token_ids) - e.num_computed_tokens == 1 and e.request.request_id not in was_waiting
                   for e in out.scheduled):
                pairs = sum(n * c + n * (n + 1) // 2 for c, n in chunks)
                assert pairs <= sched.max_prefill_pairs or (len(chunks) == 1 and chunks[0][1] == 1), (chunks, pairs)
                type(self).max_pairs = max(type(self).max_pairs, pairs)
            for rid in out.preempted:
                r = sched.get(rid)
                assert r.status == WAITING and r.block_table == [] and r.num_computed_tokens == 0
                assert rid not in ids
            admitted = was_waiting & set(ids)
            if out.preempted and policy == "fcfs":
                assert not admitted, "admitted in a step that preempted"
            still_waiting = [sched.get(rid) for rid in was_waiting - admitted]
            if admitted and still_waiting:  # who runs first: admission follows rank
                assert max(sched.get(rid).rank for rid in admitted) < min(r.rank for r in still_waiting)
            SchedulerMachine.preemptions += len(out.preempted)
            running_loras = {sched.get(rid).lora_id for rid in self.live if sched.get(rid).status == RUNNING} - {0}
            assert not max_loras or len(running_loras) <= max_loras, f"adapters {running_loras} run at once"
            assert set(sched.running_loras) == running_loras
            SchedulerMachine.max_adapters = max(SchedulerMachine.max_adapters, len(running_loras))
            holders = Counter(b for rid in self.live for b in sched.get(rid).block_table)
            for e in out.scheduled:
                r, n, computed, needs_sample = e.request, e.num_new_tokens, e.num_computed_tokens, e.needs_sample
                assert r.status == RUNNING and r.num_computed_tokens == computed and n >= 1
                own = n - len(e.draft_token_ids)
                assert needs_sample == (r.max_tokens > 0 and computed + own == len(r.token_ids))
                if e.draft_token_ids:  # a prefix of what it was given, after its one token, within its limits
                    assert own == 1 and e.draft_token_ids == self.drafted[r.request_id][:len(e.draft_token_ids)]
                    limit = min(self.max_len, r.num_prompt_tokens + r.max_tokens)
                    assert len(r.token_ids) + len(e.draft_token_ids) < limit
                assert len(r.block_table) == cdiv(computed + n, BS)
                chain = self.prefix_chain(r.token_ids + e.draft_token_ids, r.cache_salt)
                if r.request_id in was_waiting:
                    assert computed % BS == 0 and computed <= (len(r.token_ids) - 1) // BS * BS
                    assert r.prefix_hit_limit < 0 or computed <= r.prefix_hit_limit
                    assert enable_prefix_caching or computed == 0
                    if r.num_preemptions == 0 and r.request_id in self.min_hits:
                        assert computed >= self.min_hits.pop(r.request_id) * BS, f"{r} missed cached blocks"
                for pos in range(computed):  # the context it reads is its own
                    slot = r.block_table[pos // BS] * BS + pos % BS
                    assert self.kv.get(slot) == chain[pos], f"{r} reads foreign KV at {pos}"
                for pos in range(computed, computed + n):  # and it writes only private blocks
                    block = r.block_table[pos // BS]
                    assert holders[block] == 1, f"{r} writes block {block}, shared"
                    self.kv[block * BS + pos % BS] = chain[pos]
            sampled = []
            for e in out.scheduled:
                if e.draft_token_ids:  # verification kept a prefix of the drafts, then one token
                    kept = rng.randint(0, len(e.draft_token_ids))
                    sampled.append(e.draft_token_ids[:kept] + [rng.randrange(VOCAB)])
                    type(self).accepted_drafts += kept
                    type(self).rejected_drafts += len(e.draft_token_ids) - kept
                else:
                    sampled.append(rng.randrange(VOCAB) if e.needs_sample else -1)
            finished = sched.update(out, sampled)
            finished_ids = {r.request_id for r in finished}
            assert len(finished_ids) == len(finished) and finished_ids <= set(ids)
            for e, tokens in zip(out.scheduled, sampled):
                r, needs_sample = e.request, e.needs_sample
                rid = r.request_id
                reason, token = None, -1
                for token in tokens if e.draft_token_ids else [tokens] if needs_sample else []:
                    self.expected[rid].append(token)  # a stop or the length limit ends a run there
                    reason = self.expected_finish(r, token, len(self.expected[rid]))
                    if reason:
                        break
                assert r.token_ids == self.expected[rid]
                if e.draft_token_ids and reason is None:  # its token and the kept drafts are computed, no more
                    assert r.num_computed_tokens == len(r.token_ids) - 1 == e.num_computed_tokens + len(tokens)
                if not needs_sample:  # a prefill-only request ends with its prompt, every other chunk goes on
                    prompt_done = r.max_tokens == 0 and r.num_computed_tokens == len(r.token_ids)
                    reason = "length" if prompt_done else None
                if rid in finished_ids:
                    assert (r.status, r.finish_reason, r.block_table) == (FINISHED, reason, [])
                    assert r.stop_token_id == (token if reason == "stop" else -1)
                    assert sched.get(rid) is None and rid not in self.done
                    self.end(r)
                else:
                    assert reason is None and r.status == RUNNING
            SchedulerMachine.prefix_hits = max(SchedulerMachine.prefix_hits, sched.allocator.prefix_cache_hits)

        def expected_finish(self, r: Request, token: int, length: int):
            """Why appending `token`, making the request `length` tokens long, ends it (None: it goes on)."""
            num_output = length - r.num_prompt_tokens
            stops = token in r.stop_token_ids
            if stops and num_output > r.min_tokens:
                return "stop"
            if num_output >= r.max_tokens or length >= self.max_len:
                return "length"
            return None

        @precondition(lambda self: self.live)
        @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
        def abort(self, data, reason):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            r = self.sched.abort(rid, reason)
            assert (r.request_id, r.status, r.finish_reason, r.block_table) == (rid, FINISHED, reason, [])
            assert self.sched.abort(rid) is None
            self.end(r)

        @rule()
        def reset_prefix_cache(self):
            alloc = self.sched.allocator
            idle = alloc.num_used_blocks == 0
            assert alloc.reset_prefix_cache() == idle
            if idle:
                assert alloc.num_free_blocks == num_blocks
                self.computed_blocks.clear()  # nothing is cached any more
                self.min_hits.clear()

        @invariant()
        def consistent(self):
            sched = self.sched
            sched.check_invariants()
            assert self.live | self.done == set(self.expected) and not self.live & self.done
            live = [sched.get(rid) for rid in self.live]
            assert all(r is not None and r.status in (WAITING, RUNNING) for r in live), "a request is lost"
            assert sched.num_waiting + sched.num_running == len(live)
            sched.allocator.check_invariants([r.block_table for r in live])
            # The events are a replicated log: through vLLM's schema they rebuild the cache exactly.
            raw = sched.allocator.take_events()
            if raw:
                self.replica.apply(ENCODER.encode(event_batch(raw, BS, 0, {})))
            assert self.replica.hashes == sched.allocator.cached_keys
            if not live:
                assert sched.allocator.num_used_blocks == 0 and not sched.has_unfinished()

        def teardown(self):
            """Every admitted request finishes: run the steps out, a livelock fails here.

            The oldest live request is never preempted by another and gets the
            budget first, so it gains a token each step and finishes within
            2 * max_len steps (a recompute, then decodes); then the next one.
            Hypothesis calls this after a failed rule too: then keep out of the way."""
            if sys.exc_info()[0] is not None:
                return
            for seed in range(len(self.live) * 2 * (self.max_len + 1)):
                if not self.live:
                    return
                self.step(seed)
                self.consistent()
            assert not self.live, f"requests never finish: {self.live}"

    return SchedulerMachine


STATEFUL = settings(max_examples=100, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
def test_stateful_roomy_pool():
    machine = scheduler_machine(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=20)
    run_state_machine_as_test(machine, settings=STATEFUL)
    assert machine.prefix_hits > 0


@pytest.mark.slow
def test_stateful_hit_rates_in_a_pool_that_never_evicts():
    machine = scheduler_machine(num_blocks=2048, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=28,
                                check_hit_rates=True)
    run_state_machine_as_test(machine, settings=STATEFUL)
    assert machine.prefix_hits > 0


@pytest.mark.slow
def test_stateful_tiny_pool_preempts():
    machine = scheduler_machine(num_blocks=5, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=24)
    run_state_machine_as_test(machine, settings=STATEFUL)
    assert machine.preemptions > 0 and machine.prefix_hits > 0


@pytest.mark.slow
def test_stateful_vllm_hashes_in_a_tiny_pool():
    """vLLM's sha256_cbor keys: the same invariants, hits and events as Python's hash."""
    machine = scheduler_machine(num_blocks=5, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=24,
                                hash_algo="sha256_cbor")
    run_state_machine_as_test(machine, settings=settings(STATEFUL, max_examples=50))
    assert machine.preemptions > 0 and machine.prefix_hits > 0


@pytest.mark.slow
def test_stateful_priority_policy_in_a_tiny_pool():
    machine = scheduler_machine(num_blocks=5, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=24,
                                policy="priority")
    run_state_machine_as_test(machine, settings=STATEFUL)
    assert machine.preemptions > 0


@pytest.mark.slow
def test_stateful_drafts_and_rollbacks_in_a_tiny_pool():
    machine = scheduler_machine(num_blocks=6, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=24,
                                drafts=True)
    run_state_machine_as_test(machine, settings=settings(STATEFUL, max_examples=50))
    assert machine.accepted_drafts > 0 and machine.rejected_drafts > 0
    assert machine.preemptions > 0 and machine.prefix_hits > 0


@pytest.mark.slow
def test_stateful_attention_budget_cuts_late_chunks_and_every_prompt_finishes():
    machine = scheduler_machine(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=40,
                                max_prefill_pairs=60)
    run_state_machine_as_test(machine, settings=settings(STATEFUL, max_examples=50))
    assert machine.max_pairs > 40  # the budget was approached


def test_a_long_prompt_is_cut_by_its_attention_while_a_decode_runs_every_step():
    """With an attention budget of one fresh full chunk, a fresh chunk takes the whole token
    budget; later chunks shrink as the context grows, each step's pairs within the budget, and
    the decoding request gains a token in every step."""
    sched = Scheduler(128, BS, max_num_batched_tokens=64, max_model_len=1024, max_prefill_pairs=64 * 65 // 2)
    sched.add(Request("decode", [1, 2, 3], 100))
    step(sched)  # its prompt: from here on it decodes
    long = Request("long", list(range(1, 301)), 1)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 300:
        out = sched.schedule()
        assert out.scheduled[0].request.request_id == "decode" and out.scheduled[0].num_new_tokens == 1
        (c, n), = [(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled if e.request.request_id == "long"]
        assert n * c + n * (n + 1) // 2 <= sched.max_prefill_pairs
        chunks.append(n)
        sched.update(out, [7] * len(out.scheduled))
    assert chunks[0] == 63 and chunks == sorted(chunks, reverse=True) and chunks[-1] < 16, chunks


def test_a_prompt_with_no_decode_beside_it_spends_tokens_only():
    """A step without a decode keeps nobody from a next token, so a lone prompt's chunks take the
    whole token budget, far past the attention budget that would cut them beside a decode."""
    sched = Scheduler(128, BS, max_num_batched_tokens=64, max_model_len=1024, max_prefill_pairs=64 * 65 // 2)
    long = Request("long", list(range(1, 301)), 1)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 300:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        sched.update(out, [7] * len(out.scheduled))
    assert chunks == [64, 64, 64, 64, 44]


@pytest.mark.slow
def test_stateful_max_loras_bounds_the_adapters_running_at_once():
    machine = scheduler_machine(num_blocks=16, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24, max_loras=2)
    run_state_machine_as_test(machine, settings=settings(STATEFUL, max_examples=50))
    assert machine.max_adapters == 2  # the bound was reached, never passed


def test_a_request_of_one_adapter_too_many_waits_for_a_slot_and_nobody_overtakes():
    sched = Scheduler(16, BS, max_num_batched_tokens=64, max_loras=1)
    for rid, lora_id in (("a1", 1), ("base", 0), ("b", 2), ("a2", 1)):
        sched.add(Request(rid, [3, 4, 5], 2, lora_id=lora_id))
    out, _ = step(sched)
    # a1 and base run; b's adapter would be a second one, so it waits, and a2 behind it
    assert scheduled_ids(out) == ["a1", "base"]
    step(sched)  # a1 and base finish (max_tokens 2)
    assert scheduled_ids(step(sched)[0]) == ["b"]  # adapter 1 left; b runs, a2 (adapter 1) waits
    assert sched.running_loras == {2: 1}


@pytest.mark.slow
def test_stateful_tiny_pool_without_prefix_caching():
    machine = scheduler_machine(num_blocks=5, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=24,
                                enable_prefix_caching=False)
    run_state_machine_as_test(machine, settings=settings(STATEFUL, max_examples=30))
    assert machine.preemptions > 0
