"""The continuous-batching scheduler: who runs each step, with how many tokens.

Each step spends a token budget (`max_num_batched_tokens`) over at most
`max_num_seqs` requests. Running requests go first, oldest first: a decode costs
one token, an unfinished prompt continues with as large a chunk as the budget
leaves (chunked prefill). In a step where some running request decodes, a prompt's chunk
also spends a second budget, `max_prefill_pairs` (0: no such limit), in what its attention
costs: the query-key pairs it covers (causal: chunk x tokens before it, plus chunk x (chunk + 1)
/ 2). A chunk late in a long prompt attends to everything before it, so at one token budget it
would cost many times an early chunk, and every decoding request would wait that long for its
next token; with both budgets a step's cost stays bounded however long the prompt. A step with
no decode has nobody waiting on it for a next token, and its prompts spend tokens only: cutting
them into small late chunks would only make them slower, each step reading the weights again.
The oldest prompt in a step always gets at least one token, so it progresses. Then waiting
requests are admitted in arrival order, each starting after the blocks the prefix cache already
holds for it, until the budget, the sequence limit or the free blocks run out; the first one
that does not fit stops admission, so nobody overtakes.

Blocks are allocated as tokens are scheduled. When a running request needs a
block and none is left, the newest running request is preempted by recompute: its
blocks go back (its full blocks stay in the prefix cache, so the recompute is often
cheap), it keeps its output tokens, and it goes to the front of the waiting queue.
Only the newest is ever a victim, so the oldest request always makes progress.

Ordering needs no sorting: admission takes the head of `waiting` and appends to
`running`, preemption moves the tail of `running` to the head of `waiting`, so
arrival order holds along running + waiting at all times, and the newest running
request is simply the last one.

Under the "priority" policy (vLLM's: a lower `priority` runs first) each request's rank is
(priority, arrival) instead of arrival alone ("fcfs" ranks every request at priority 0, which
is the order above). `waiting` and `running` are each kept in rank order, by insertion that
scans from the back (one comparison for a new arrival), so the best waiting request is admitted first, running requests get
the budget best first, and out of blocks the worst-ranked running request is the one
preempted. A waiting request that outranks the worst running one and cannot be admitted (no
blocks, or max_num_seqs running) preempts running requests, worst first, before the step is
planned, until it fits.

With `max_loras` set, the requests running at once use at most that many distinct LoRA
adapters (`Request.lora_id`, 0: the base model), since each needs one of the model's adapter
slots. A waiting request whose adapter would be one too many does not fit, like one without
blocks: admission stops there until a running request of another adapter finishes.

Speculative decoding: the engine may give a decoding request draft tokens
(`Request.draft_token_ids`, set before `schedule()`, consumed by it). A decode with drafts
computes its last token and the drafts in one chunk (`ScheduledRequest.draft_token_ids`),
and `update()` takes the tokens its verification emitted: the accepted drafts and one more.
Only the KV of what was accepted counts as computed; blocks allocated past it go back at
once, and no block holding a rejected draft ever enters the prefix cache. Drafts ride only
where they cost nothing else: within the token budget, the request's `max_tokens` and the
context, and in blocks that are free (a draft never preempts anyone).

The file runs both compiled and as plain Python (Cython's pure-Python mode).
"""
from collections import deque

import cython

if cython.compiled:
    from cython.cimports.trillm.sched_ext.allocator import BlockAllocator
else:
    from trillm.sched_ext.allocator import BlockAllocator

from trillm.sched_ext.status import FinishReason, RequestStatus, SchedulingPolicy

COMPILED = cython.compiled
# As plain ints for the compiled comparisons in the hot loops; `Request.status` is the enum.
WAITING: cython.int = RequestStatus.WAITING
RUNNING: cython.int = RequestStatus.RUNNING
FINISHED: cython.int = RequestStatus.FINISHED


@cython.cfunc
@cython.inline
def _cdiv(a: cython.int, b: cython.int) -> cython.int:
    return (a + b - 1) // b


NO_PAIRS_LIMIT: cython.longlong = 1 << 62  # max_prefill_pairs 0: prompt chunks spend tokens only


@cython.cfunc
@cython.inline
def _pairs(computed: cython.int, chunk: cython.int) -> cython.longlong:
    """Query-key pairs a causal chunk of `chunk` tokens after `computed` ones attends over."""
    return cython.cast(cython.longlong, chunk) * computed + cython.cast(cython.longlong, chunk) * (chunk + 1) // 2


@cython.cfunc
def _pairs_fit(computed: cython.int, want: cython.int, pairs: cython.longlong) -> cython.int:
    """The longest chunk of at most `want` tokens after `computed` ones whose pairs are at most
    `pairs` (0 if none)."""
    if _pairs(computed, want) <= pairs:
        return want
    if pairs <= 0:
        return 0
    b: cython.double = 2.0 * computed + 1.0
    chunk: cython.int = min(cython.cast(cython.int, (-b + (b * b + 8.0 * pairs) ** 0.5) / 2.0), want)
    while chunk > 0 and _pairs(computed, chunk) > pairs:  # the float's rounding, corrected
        chunk -= 1
    while chunk < want and _pairs(computed, chunk + 1) <= pairs:
        chunk += 1
    return chunk


def _insert_ranked(queue, request) -> None:
    """Insert into a rank-ordered list or deque, scanning from the end: new arrivals (and, under
    fcfs, everything admitted) belong last, so this is usually one comparison."""
    i = len(queue)
    while i > 0 and queue[i - 1].rank > request.rank:
        i -= 1
    queue.insert(i, request)


@cython.cclass
class Request:
    """One sequence: its prompt, its output so far, and where it stands.

    `max_tokens` 0 makes a prefill-only request: it computes its prompt, samples nothing, and
    finishes with "length" in the step that computes its last prompt token (an embedding, or a
    prompt whose logprobs alone were asked). `prefix_hit_limit` (tokens, -1: none) caps what its
    first blocks may take from the prefix cache: a cached block has KV but no hidden states, and
    prompt logprobs or mean pooling need the hidden state of every row they cover. The request's
    own full blocks still enter the cache. `cache_salt` ("": none) isolates its cached blocks:
    only requests with the same salt share them. `lora_id` (0: none) names its LoRA adapter, for
    the scheduler's `max_loras` bound; its cache isolation is the salt's business.
    `hash_extra_keys` (None: from the salt) are vLLM's extra keys of its first block and of the
    others, for sha256_cbor prefix keys (allocator.pyx)."""

    request_id = cython.declare(str, visibility="readonly")
    token_ids = cython.declare(list, visibility="readonly")
    num_prompt_tokens = cython.declare(cython.int, visibility="readonly")
    max_tokens = cython.declare(cython.int, visibility="readonly")
    min_tokens = cython.declare(cython.int, visibility="readonly")
    stop_token_ids = cython.declare(frozenset, visibility="readonly")  # EOS ids included (the caller's choice)
    prefix_hit_limit = cython.declare(cython.int, visibility="readonly")
    cache_salt = cython.declare(str, visibility="readonly")
    priority = cython.declare(cython.int, visibility="readonly")
    lora_id = cython.declare(cython.int, visibility="readonly")
    hash_extra_keys = cython.declare(tuple, visibility="readonly")
    rank = cython.declare(tuple, visibility="readonly")  # (priority under the policy, arrival); set by add()
    arrival = cython.declare(cython.double, visibility="readonly")
    num_computed_tokens = cython.declare(cython.int, visibility="readonly")
    num_cached_tokens = cython.declare(cython.int, visibility="readonly")
    block_table = cython.declare(list, visibility="readonly")
    _status: cython.int
    finish_reason = cython.declare(object, visibility="readonly")  # a FinishReason once finished
    stop_token_id = cython.declare(cython.int, visibility="readonly")
    num_preemptions = cython.declare(cython.int, visibility="readonly")
    # Speculative tokens for the next decode (the engine's drafter sets them; schedule() takes them)
    draft_token_ids = cython.declare(list, visibility="public")
    _block_hashes: list  # memo of the prefix-cache hash chain over full blocks
    _seq: cython.longlong  # arrival counter, set by Scheduler.add

    def __init__(self, request_id: str, prompt_token_ids, max_tokens: cython.int, *,
                 min_tokens: cython.int = 0, stop_token_ids=(), prefix_hit_limit: cython.int = -1,
                 cache_salt: str = "",
                 priority: cython.int = 0, arrival: cython.double = 0.0, lora_id: cython.int = 0,
                 hash_extra_keys: tuple = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        if not self.token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if max_tokens < 0:
            raise ValueError(f"request {request_id!r}: max_tokens must be non-negative, got {max_tokens}")
        if min_tokens < 0:
            raise ValueError(f"request {request_id!r}: min_tokens must be non-negative, got {min_tokens}")
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.prefix_hit_limit = prefix_hit_limit
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_id = lora_id
        assert hash_extra_keys is None or len(hash_extra_keys) == 2, "the first block's keys and the others'"
        self.hash_extra_keys = hash_extra_keys
        self.rank = None
        self.arrival = arrival
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self._status = WAITING
        self.finish_reason = None
        self.stop_token_id = -1
        self.num_preemptions = 0
        self.draft_token_ids = []
        self._block_hashes = []
        self._seq = -1

    @property
    def status(self) -> RequestStatus:
        return RequestStatus(self._status)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, computed={self.num_computed_tokens}"
                f"/{len(self.token_ids)}, blocks={self.block_table}, finish_reason={self.finish_reason!r})")


@cython.cclass
class ScheduledRequest:
    """One request's part of a step: compute `num_new_tokens` tokens from position
    `num_computed_tokens`: its own tokens from there on, then `draft_token_ids` (a decode's
    speculative tokens; empty for most). `needs_sample`: the step reaches the end of its tokens
    (a decode, or its prompt's last chunk), so a token is sampled for it, and with drafts one
    at each draft's position too (`num_sample_rows`)."""

    request = cython.declare(Request, visibility="readonly")
    num_new_tokens = cython.declare(cython.int, visibility="readonly")
    num_computed_tokens = cython.declare(cython.int, visibility="readonly")
    needs_sample = cython.declare(cython.bint, visibility="readonly")
    draft_token_ids = cython.declare(list, visibility="readonly")

    def __init__(self, request: Request, num_new_tokens: cython.int, draft_token_ids: list = None):
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.num_computed_tokens = request.num_computed_tokens
        self.draft_token_ids = [] if draft_token_ids is None else draft_token_ids
        own: cython.int = num_new_tokens - len(self.draft_token_ids)
        self.needs_sample = request.max_tokens > 0 and self.num_computed_tokens + own == len(request.token_ids)
        assert not self.draft_token_ids or (own == 1 and self.needs_sample), "drafts follow a decode's token"

    @property
    def num_sample_rows(self) -> int:
        """The chunk's last rows that get logits: its own last token's, and each draft's."""
        return len(self.draft_token_ids) + 1 if self.needs_sample else 0

    def __repr__(self):
        return (f"ScheduledRequest({self.request.request_id!r}, new={self.num_new_tokens}, "
                f"computed={self.num_computed_tokens}, sample={bool(self.needs_sample)}, "
                f"drafts={len(self.draft_token_ids)})")


@cython.final
@cython.cclass
class SchedulerOutput:
    """One step's plan: a ScheduledRequest per scheduled request.

    Entries that compute one token (decodes) come first, `num_decodes` of them,
    then the prefill chunks and the decodes with drafts, each group in scheduling order.
    """

    scheduled = cython.declare(list, visibility="readonly")  # list[ScheduledRequest]
    total_num_tokens = cython.declare(cython.int, visibility="readonly")
    num_decodes = cython.declare(cython.int, visibility="readonly")
    preempted = cython.declare(list, visibility="readonly")

    def __init__(self):
        self.scheduled = []
        self.total_num_tokens = 0
        self.num_decodes = 0
        self.preempted = []

    @cython.cfunc
    def _add(self, request: Request, num_new: cython.int, drafts: list = None):
        self.scheduled.append(ScheduledRequest(request, num_new, drafts))
        self.total_num_tokens += num_new

    @cython.cfunc
    def _extend(self, other: "SchedulerOutput"):
        self.scheduled.extend(other.scheduled)
        self.total_num_tokens += other.total_num_tokens


@cython.cclass
class Scheduler:
    """Continuous batching over a paged KV cache; see the module docstring."""

    allocator = cython.declare(BlockAllocator, visibility="readonly")
    block_size = cython.declare(cython.int, visibility="readonly")
    max_num_batched_tokens = cython.declare(cython.int, visibility="readonly")
    max_prefill_pairs = cython.declare(cython.longlong, visibility="readonly")
    max_num_seqs = cython.declare(cython.int, visibility="readonly")
    max_model_len = cython.declare(cython.int, visibility="readonly")
    _max_len: cython.int  # a request whose token_ids reach this length is done
    policy = cython.declare(object, visibility="readonly")  # a SchedulingPolicy
    _by_priority: cython.bint  # policy is SchedulingPolicy.PRIORITY
    max_loras = cython.declare(cython.int, visibility="readonly")  # 0: no bound
    _lora_running: dict  # lora_id -> running requests using it (base-model requests not counted)
    _waiting: object  # deque[Request], in rank order
    _running: list  # list[Request], in rank order
    _requests: dict  # request_id -> Request, for every live request
    _next_seq: cython.longlong
    _preempted_for_rank: cython.bint  # this schedule() preempted for a better-ranked waiting request
    _pairs_left: cython.longlong  # this schedule()'s attention pairs left for prompt chunks (no limit without a decode)
    _any_prefill: cython.bint  # this schedule() gave some prompt a chunk

    def __init__(self, num_blocks: cython.int, block_size: cython.int = 16,
                 max_num_batched_tokens: cython.int = 2048, max_num_seqs: cython.int = 256,
                 max_model_len: cython.int = 8192, enable_prefix_caching: cython.bint = True, policy=SchedulingPolicy.FCFS,
                 max_loras: cython.int = 0, max_prefill_pairs: cython.longlong = 0,
                 record_kv_events: cython.bint = False, hash_algo: str = "builtin"):
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2 or max_loras < 0 or max_prefill_pairs < 0:
            raise ValueError("need max_num_batched_tokens >= 1, max_num_seqs >= 1, max_model_len >= 2, max_loras >= 0 "
                             "and max_prefill_pairs >= 0")
        if policy not in list(SchedulingPolicy):
            raise ValueError(f"the scheduling policy is fcfs or priority, got {policy!r}")
        self.policy = SchedulingPolicy(policy)
        self._by_priority = self.policy == SchedulingPolicy.PRIORITY
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching, record_kv_events, hash_algo)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_pairs = max_prefill_pairs or NO_PAIRS_LIMIT
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # A request alone must always be able to go on, or preemption would loop:
        # it stops at the context length or once its KV would outgrow the pool.
        self._max_len = min(max_model_len, num_blocks * block_size + 1)
        self.max_loras = max_loras
        self._lora_running = {}
        self._waiting = deque()
        self._running = []
        self._requests = {}
        self._next_seq = 0
        self._preempted_for_rank = False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return len(self._waiting) > 0 or len(self._running) > 0

    def get(self, request_id: str):
        return self._requests.get(request_id)

    def add(self, request: Request):
        """Queue a fresh request; ValueError if it could never run."""
        num_prompt: cython.int = request.num_prompt_tokens
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request._status != WAITING or len(request.token_ids) != num_prompt:
            raise ValueError(f"request {request.request_id!r} has already been scheduled; add a new Request")
        if num_prompt >= self.max_model_len:
            raise ValueError(f"the prompt has {num_prompt} tokens, which leaves no room for output "
                             f"within the context length of {self.max_model_len} tokens")
        if _cdiv(num_prompt + 1, self.block_size) > self.allocator.num_blocks:
            raise ValueError(f"the prompt has {num_prompt} tokens and cannot fit in the KV cache "
                             f"({self.allocator.num_blocks} blocks of {self.block_size} tokens)")
        request._seq = self._next_seq
        request.rank = (request.priority if self._by_priority else 0, request._seq)
        self._next_seq += 1
        _insert_ranked(self._waiting, request)
        self._requests[request.request_id] = request

    def abort(self, request_id: str, reason=FinishReason.ABORT):
        """Finish a live request now and free its blocks; None if not live. `reason`: a
        FinishReason, or its value."""
        request: Request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request._status == WAITING:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self._lora_leaves(request)
            self.allocator.free(request.block_table)
        request._status = FINISHED
        request.finish_reason = FinishReason(reason)
        return request

    @cython.ccall
    def schedule(self) -> SchedulerOutput:
        """Plan one step; see the module docstring for the policy."""
        out: SchedulerOutput = SchedulerOutput()
        prefills: SchedulerOutput = SchedulerOutput()
        alloc: BlockAllocator = self.allocator
        if self._by_priority:
            self._preempt_for_better_ranked(out)
        running: list = self._running
        budget: cython.int = self.max_num_batched_tokens
        self._pairs_left = self.max_prefill_pairs if self._any_decoding() else NO_PAIRS_LIMIT
        self._any_prefill = False
        block_size: cython.int = self.block_size
        request: Request
        computed: cython.int
        num_new: cython.int
        remaining: cython.int
        need: cython.int
        with_drafts: cython.int
        i: cython.int = 0
        drafts: list
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            remaining = len(request.token_ids) - computed
            num_new = self._chunk(computed, remaining, budget)
            if num_new == 0:
                i += 1  # a prompt whose chunk the step has no attention left for: a later step
                continue
            need = _cdiv(computed + num_new, block_size) - len(request.block_table)
            assert num_new > 0 and need >= 0, "schedule() called twice without update()"
            drafts = self._take_drafts(request, remaining, budget)
            if drafts:
                with_drafts = _cdiv(computed + 1 + len(drafts), block_size) - len(request.block_table)
                if with_drafts == need or alloc.can_allocate(with_drafts):
                    need = with_drafts
                else:
                    drafts = []  # no free blocks for them: the plain decode
            if need > 0:
                if not self._make_room(need, request, out):
                    break  # it preempted itself, being the newest
                alloc.allocate(request.block_table, need)
            self._spend_pairs(computed, num_new, remaining)
            if drafts:
                prefills._add(request, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
            else:
                (out if num_new == 1 else prefills)._add(request, num_new)
                budget -= num_new
            i += 1
        if not out.preempted or self._preempted_for_rank:
            budget = self._admit(budget, out, prefills)
        self._preempted_for_rank = False
        out.num_decodes = len(out.scheduled)
        out._extend(prefills)
        assert out.total_num_tokens == self.max_num_batched_tokens - budget
        return out

    @cython.cfunc
    def _any_decoding(self) -> cython.bint:
        """Whether a running request decodes (its prompt is computed): the step would keep it
        waiting for its next token."""
        request: Request
        for request in self._running:
            if len(request.token_ids) - request.num_computed_tokens <= 1:
                return True
        return False

    @cython.cfunc
    def _chunk(self, computed: cython.int, remaining: cython.int, budget: cython.int) -> cython.int:
        """Tokens to compute now for a request with `computed` done and `remaining` to go: within
        the token budget and, for a prompt's chunk (more than one token to go), within the
        attention pairs left. The step's first prompt chunk gets at least one token; another
        that cannot fit gets 0 (it waits a step). Spends nothing: `_spend_pairs` does, once the
        chunk is scheduled."""
        num_new: cython.int = min(remaining, budget)
        if remaining <= 1:
            return num_new  # a decode
        fit: cython.int = _pairs_fit(computed, num_new, self._pairs_left)
        if fit < num_new:
            num_new = fit if fit > 0 or self._any_prefill else 1
        return num_new

    @cython.cfunc
    def _take_drafts(self, request: Request, remaining: cython.int, budget: cython.int) -> list:
        """The drafts a decode may verify this step (its own token first): at most what the token
        budget leaves after it and what its max_tokens and the context leave after one more
        token. Takes them off the request either way: a draft is for one step."""
        drafts: list = request.draft_token_ids
        if not drafts:
            return drafts
        request.draft_token_ids = []
        if remaining != 1 or request.max_tokens == 0:
            return []
        num_output: cython.int = len(request.token_ids) - request.num_prompt_tokens
        room: cython.int = min(budget - 1, request.max_tokens - num_output - 1, self._max_len - len(request.token_ids) - 1)
        return drafts[:room] if room > 0 else []

    @cython.cfunc
    def _spend_pairs(self, computed: cython.int, num_new: cython.int, remaining: cython.int):
        """A scheduled prompt chunk's pairs leave the step's attention budget."""
        if remaining > 1:
            self._pairs_left -= _pairs(computed, num_new)
            self._any_prefill = True

    @cython.cfunc
    def _make_room(self, need: cython.int, request: Request, out: SchedulerOutput) -> cython.bint:
        """Preempt the newest running requests until `need` blocks are free.
        False if `request` itself had to go."""
        victim: Request
        while not self.allocator.can_allocate(need):
            victim = self._preempt_last(out)
            if victim is request:
                return False
        return True

    @cython.cfunc
    def _preempt_last(self, out: SchedulerOutput) -> Request:
        """Preempt the worst-ranked running request by recompute; it waits, in rank order."""
        victim: Request = self._running.pop()
        self._lora_leaves(victim)
        self.allocator.free(victim.block_table)
        victim.num_computed_tokens = 0
        victim._status = WAITING
        victim.num_preemptions += 1
        _insert_ranked(self._waiting, victim)
        out.preempted.append(victim.request_id)
        return victim

    @cython.cfunc
    def _preempt_for_better_ranked(self, out: SchedulerOutput):
        """Priority policy: while the best waiting request outranks the worst running one and
        could not be admitted now (no blocks for its first chunk, or max_num_seqs running),
        preempt the worst running one. Admission in this step then goes ahead."""
        head: Request
        alloc: BlockAllocator = self.allocator
        while len(self._waiting) > 0 and len(self._running) > 0:
            head = self._waiting[0]
            if head.rank >= self._running[len(self._running) - 1].rank:
                return
            num_tokens: cython.int = len(head.token_ids)
            hits = alloc.match_prefix(head.token_ids, head._block_hashes, self._max_prefix_hits(head), head.cache_salt,
                                      head.hash_extra_keys)
            first = len(hits) * self.block_size + min(num_tokens - len(hits) * self.block_size,
                                                        self.max_num_batched_tokens)
            need: cython.int = _cdiv(first, self.block_size) - len(hits)
            if len(self._running) < self.max_num_seqs and alloc.can_allocate(need, hits):
                return
            self._preempt_last(out)
            self._preempted_for_rank = True

    @cython.cfunc
    def _max_prefix_hits(self, request: Request) -> cython.int:
        """Blocks a waiting request may take from the prefix cache: its full blocks but the one
        holding its last token (whose logits give the next token), within its prefix_hit_limit."""
        if not self.allocator.enable_prefix_caching:
            return 0
        max_hits: cython.int = (len(request.token_ids) - 1) // self.block_size
        if request.prefix_hit_limit >= 0:
            max_hits = min(max_hits, request.prefix_hit_limit // self.block_size)
        return max_hits

    @cython.cfunc
    def _admit(self, budget: cython.int, out: SchedulerOutput, prefills: SchedulerOutput) -> cython.int:
        """Admit waiting requests in order while they fit; returns the budget left."""
        alloc: BlockAllocator = self.allocator
        waiting = self._waiting
        block_size: cython.int = self.block_size
        request: Request
        hits: list
        num_tokens: cython.int
        max_hits: cython.int
        computed: cython.int
        num_new: cython.int
        need: cython.int
        while budget > 0 and len(waiting) > 0 and len(self._running) < self.max_num_seqs:
            request = waiting[0]
            if request.request_id in out.preempted:
                break  # preempted by this very schedule(): it waits for a later step
            num_tokens = len(request.token_ids)
            max_hits = self._max_prefix_hits(request)
            hits = alloc.match_prefix(request.token_ids, request._block_hashes, max_hits, request.cache_salt,
                                      request.hash_extra_keys)
            computed = len(hits) * block_size
            num_new = self._chunk(computed, num_tokens - computed, budget)
            need = _cdiv(computed + num_new, block_size) - len(hits)
            if num_new == 0 or not alloc.can_allocate(need, hits) or not self._lora_fits(request):
                break
            self._spend_pairs(computed, num_new, num_tokens - computed)
            waiting.popleft()
            alloc.acquire_prefix(request.block_table, hits, max_hits)
            alloc.allocate(request.block_table, need)
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed
            request.num_computed_tokens = computed
            request._status = RUNNING
            self._lora_joins(request)
            _insert_ranked(self._running, request)
            (out if num_new == 1 else prefills)._add(request, num_new)
            budget -= num_new
        return budget

    @cython.cfunc
    def _lora_fits(self, request: Request) -> cython.bint:
        """Whether running `request` keeps the running adapters within max_loras."""
        return (self.max_loras == 0 or request.lora_id == 0 or request.lora_id in self._lora_running
                or len(self._lora_running) < self.max_loras)

    @cython.cfunc
    def _lora_joins(self, request: Request):
        """A request starts running (admitted)."""
        if request.lora_id:
            self._lora_running[request.lora_id] = self._lora_running.get(request.lora_id, 0) + 1

    @cython.cfunc
    def _lora_leaves(self, request: Request):
        """A running request stops running (finished, aborted or preempted)."""
        if request.lora_id:
            left: cython.int = self._lora_running[request.lora_id] - 1
            if left:
                self._lora_running[request.lora_id] = left
            else:
                del self._lora_running[request.lora_id]

    @property
    def running_loras(self) -> dict:
        """lora_id -> running requests using it (a copy)."""
        return dict(self._lora_running)

    @cython.ccall
    def update(self, output: SchedulerOutput, sampled: list) -> list:
        """Apply one step's results; returns the requests that finished in it.

        `sampled[k]` is the token sampled for `output.scheduled[k]` (ignored where
        it needs no sample); for an entry with drafts, the list of tokens its verification
        emitted (its accepted drafts, then one more: 1 to len(drafts) + 1 tokens). A request
        aborted since `schedule()` is skipped.
        """
        count: cython.Py_ssize_t = len(output.scheduled)
        assert len(sampled) == count, f"{len(sampled)} sampled tokens for {count} scheduled requests"
        alloc: BlockAllocator = self.allocator
        finished: list = []
        request: Request
        entry: ScheduledRequest
        before: cython.int
        after: cython.int
        k: cython.Py_ssize_t
        for k in range(count):
            entry = output.scheduled[k]
            request = entry.request
            if request._status != RUNNING:
                continue
            before = request.num_computed_tokens
            assert before == entry.num_computed_tokens, "update() with a stale SchedulerOutput"
            if entry.draft_token_ids:
                if self._verified(request, entry, sampled[k]):
                    finished.append(request)
                continue
            after = before + entry.num_new_tokens
            request.num_computed_tokens = after
            self._cache_new_full_blocks(request, before, after)
            if entry.needs_sample:
                if self._append_token(request, sampled[k]):
                    finished.append(request)
            elif request.max_tokens == 0 and after == len(request.token_ids):
                request.finish_reason = FinishReason.LENGTH  # prefill only: its prompt is done
                request._status = FINISHED
                finished.append(request)
        if finished:
            for request in finished:
                self._lora_leaves(request)
                alloc.free(request.block_table)
                del self._requests[request.request_id]
            self._running = [request for request in self._running if request._status == RUNNING]
        return finished

    @cython.cfunc
    def _verified(self, request: Request, entry: ScheduledRequest, emitted: list) -> cython.bint:
        """Apply a decode-with-drafts' verification; True if it finishes the request. `emitted`:
        the accepted drafts, then the token sampled after them. The KV of the decode's token and
        of the accepted drafts counts as computed; the blocks past it are freed (they held only
        rejected drafts), and only blocks full of accepted tokens enter the prefix cache."""
        num: cython.Py_ssize_t = len(emitted)
        assert 1 <= num <= len(entry.draft_token_ids) + 1, "a verification emits 1 to drafts + 1 tokens"
        assert list(emitted[:num - 1]) == entry.draft_token_ids[:num - 1], "emitted tokens past a rejected draft"
        block_size: cython.int = self.block_size
        before: cython.int = request.num_computed_tokens
        j: cython.Py_ssize_t
        for j in range(num):
            if self._append_token(request, emitted[j]):
                return True  # a stop token or the length limit inside the run: the rest is dropped
        after: cython.int = before + num
        request.num_computed_tokens = after
        keep: cython.int = _cdiv(after, block_size)
        if len(request.block_table) > keep:
            tail: list = request.block_table[keep:]
            del request.block_table[keep:]
            self.allocator.free(tail)
        self._cache_new_full_blocks(request, before, after)
        return False

    @cython.cfunc
    def _cache_new_full_blocks(self, request: Request, before: cython.int, after: cython.int):
        """The blocks that computing tokens before..after filled enter the prefix cache."""
        block_size: cython.int = self.block_size
        if after // block_size > before // block_size:
            self.allocator.cache_full_blocks(request.block_table, request.token_ids, request._block_hashes,
                                             before // block_size, after // block_size, request.cache_salt,
                                             request.lora_id, request.hash_extra_keys)

    @cython.cfunc
    def _append_token(self, request: Request, token: cython.int) -> cython.bint:
        """Append a sampled token; True if it finishes the request.

        Stop tokens (EOS among them) count only once `min_tokens` other tokens
        precede them; a stop wins over a length limit reached by the same token.
        """
        request.token_ids.append(token)
        num_output: cython.int = len(request.token_ids) - request.num_prompt_tokens
        if num_output > request.min_tokens and token in request.stop_token_ids:
            request.finish_reason = FinishReason.STOP
            request.stop_token_id = token
        elif num_output >= request.max_tokens or len(request.token_ids) >= self._max_len:
            request.finish_reason = FinishReason.LENGTH
        else:
            return False
        request._status = FINISHED
        return True

    def check_invariants(self):
        """Assert the scheduler's and the allocator's invariants (tests call it)."""
        request: Request
        self.allocator.check_invariants([request.block_table for request in self._running])
        assert len(self._running) <= self.max_num_seqs
        counted: dict = {}
        for request in self._running:
            if request.lora_id:
                counted[request.lora_id] = counted.get(request.lora_id, 0) + 1
        assert counted == self._lora_running, "the running adapters' counts are off"
        assert self.max_loras == 0 or len(counted) <= self.max_loras, "more adapters run than max_loras"
        assert len(self._requests) == len(self._running) + len(self._waiting), "a live request is lost"
        last_seq = -1
        for request in self._running:
            assert request._status == RUNNING and self._requests[request.request_id] is request
            assert 0 <= request.num_computed_tokens < len(request.token_ids) < self._max_len
            assert len(request.block_table) == _cdiv(request.num_computed_tokens, self.block_size)
            assert self._by_priority or request._seq > last_seq, "running + waiting is out of arrival order"
            last_seq = request._seq
        for ranked in (self._running, self._waiting):
            ranks = [request.rank for request in ranked]
            assert ranks == sorted(ranks), "a queue is out of rank order"
        for request in self._waiting:
            assert request._status == WAITING and self._requests[request.request_id] is request
            assert request.num_computed_tokens == 0 and not request.block_table
            assert len(request.token_ids) < self._max_len
            assert self._by_priority or request._seq > last_seq, "running + waiting is out of arrival order"
            last_seq = request._seq
