"""EngineCore: the synchronous heart of trillm.

One `step()` schedules, runs the model, samples and updates. Only one caller ever
drives it (the offline loop, or the AsyncEngine's task between two steps), so it
holds no locks: adds and aborts are applied between steps, never during one.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import torch

from trillm.config import EngineArgs
from trillm.engine.draft_policy import DraftPolicy
from trillm.engine.drafting import NgramDrafter, SpeculativeConfig
from trillm.engine.flag_check import check_flags, parse_lora_modules
from trillm.engine.kv_events import KVEventsConfig, ZmqEventPublisher, event_batch
from trillm.engine.pooler import Pooler
from trillm.engine.prompt_logprobs import PromptLogprobs, fill_prompt_logprobs
from trillm.engine.request import EngineRequest
from trillm.model import memory, parallel
from trillm.model.llama import head_dim_of
from trillm.model.loader import ModelConfig, resolve_device
from trillm.model.lora import LoRAAdapter, LoRAError, LoRARegistry, LoRAWeights
from trillm.model.runner import ModelRunner, SleepTag
from trillm.model.tp_worker import Workers, launcher_init_method, launcher_rank
from trillm.engine.sampler import Sampler, SamplingBatch, TokenLogprobs
from trillm.engine.stats import EngineStats
from trillm.engine.suffix_drafter import SuffixCache, SuffixDrafter
from trillm.engine.structured_output import Grammars, accept
from trillm.engine.verification import (SeededStreams, SpecDecodeCounts, logit_groups, sampling_rows,
                                        verified_run)
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParamError, SamplingParams
from trillm.sched_ext import (FinishReason, Request, RequestStatus, Scheduler, SchedulerOutput, SchedulingPolicy,
                              vllm_extra_keys)
from trillm.sched_ext.status import PrefixHashAlgo


@dataclass
class StepOutput:
    """What one request produced in one step (or its end, for an abort)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    # In the output of the step that computed the prompt's last token, when asked:
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # from params.prompt_logprobs_start on
    pooled: torch.Tensor | None = None  # a pooling request's vector: fp32 [hidden], raw

    def then(self, later: StepOutput) -> StepOutput:
        """This output and the same request's next as one, as if one step had made both (a
        reader that fell behind takes them at once)."""
        assert later.request_id == self.request_id and not self.finished
        logprobs = None  # an abort's final output carries none, even for a request that asked
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        # field by field: dataclasses.replace costs several times as much, paid for every merged output
        return StepOutput(later.request_id, self.new_token_ids + later.new_token_ids, logprobs, later.finished,
                          later.finish_reason, later.stop_token_id, later.num_prompt_tokens, later.num_cached_tokens,
                          self.prompt_logprobs or later.prompt_logprobs,
                          self.pooled if self.pooled is not None else later.pooled)


# On CPU a step's prompt chunks attend over at most the pairs of a fresh 512-token chunk. The
# attention there costs more per pair than its multiply-adds say (well off the FMA roof), so the
# budget is set from what a step costs, not from the model's shapes: a step stays a fraction of
# a second, and a fresh chunk is at most 511 tokens, while short prompts still share a step by
# the dozen. Only a step beside a decoding request is held to it (the scheduler): a lone long
# prompt cut into small late chunks would take far longer than its pairs cost, every step
# reading the weights again.
CPU_PREFILL_PAIRS = 512 * 513 // 2


def prefill_pairs_budget(config, max_num_batched_tokens: int, device: torch.device) -> int:
    """The attention pairs a step's prompt chunks may cover by default. On CPU, CPU_PREFILL_PAIRS.
    Elsewhere, as many as cost what the projections of a full token budget cost: per layer, a
    token's projections are about hidden x (q + k + v + o + 3 x intermediate) multiply-adds and
    one query-key pair's attention 2 x heads x head_dim (the score and the value), so a step of
    any prompt costs at most about twice a fresh full chunk's projections."""
    if device.type == "cpu":
        return CPU_PREFILL_PAIRS
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    hidden = config.hidden_size
    projections = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 3 * hidden * config.intermediate_size
    return max_num_batched_tokens * max(projections // (2 * heads * head_dim), 1)


class EngineCore:
    def __init__(self, args: EngineArgs):
        """With tensor_parallel_size > 1 this is rank 0: it starts the other ranks (unless a
        launcher did, trillm.model.tp_worker) and joins their group before loading its shard.
        `close()` stops them."""
        check_flags(args)  # before any rank starts or anything loads
        self.workers: Workers | None = None
        self.kv_events: ZmqEventPublisher | None = None
        self.tp = parallel.SINGLE
        self._in_group = False  # joined the process's group and not yet left it
        try:
            self._build(self._join_group(args))
        except BaseException:  # nothing half-made stays behind: neither the ranks nor the group
            self._stop_workers(wait=False)
            self._leave_group()
            raise

    def _join_group(self, args: EngineArgs) -> EngineArgs:
        """At tensor_parallel_size > 1: the other ranks started (unless a launcher did) and their
        group joined. The args, with the group's meeting point filled in."""
        if args.tensor_parallel_size > 1:
            if launcher_rank() is None:
                self.workers, args = Workers.start(args)
            elif args.tp_init_method is None:
                args = replace(args, tp_init_method=launcher_init_method())
            self.tp = parallel.join(0, args.tensor_parallel_size, args.tp_init_method, resolve_device(args.device),
                                    args.tp_timeout, self.workers.all_alive if self.workers else None)
            self._in_group = True
        return args

    def _build(self, args: EngineArgs) -> None:
        """This rank's shard, the scheduler, and what serves requests beside them."""
        self.args = args
        self.runner = ModelRunner(args, self.tp)
        self.config = self.runner.config  # resolved once, by the loader
        self.tokenizer = self.runner.tokenizer
        kv_events = KVEventsConfig.parse(args.kv_events_config)
        self.scheduler = Scheduler(
            self.runner.num_kv_blocks,
            args.block_size,
            self.config.max_num_batched_tokens,
            args.max_num_seqs,
            self.config.max_model_len,
            args.enable_prefix_caching,
            args.scheduling_policy,
            args.max_loras if args.enable_lora else 0,
            prefill_pairs_budget(self.config.hf_config, self.config.max_num_batched_tokens, self.config.device)
            if args.max_prefill_pairs is None else args.max_prefill_pairs,
            kv_events.enabled,
            args.prefix_caching_hash_algo.value,  # a str: Cython refuses a str subclass for one
        )
        # The adapters requests may name (None: LoRA is off)
        self.loras: LoRARegistry | None = None
        if args.enable_lora:
            self.loras = LoRARegistry(self.config.hf_config, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
            for name, path in parse_lora_modules(args.lora_modules):
                self.load_lora(name, path, self.loras.read(path))
        self.sampler = Sampler()
        self.grammars = Grammars.of(self.tokenizer, self.config, args.grammar_compile_timeout)
        self.requests: dict[str, EngineRequest] = {}  # live requests, from add_request to their end
        self._staged: tuple[str, object] | None = None  # new weights loaded, not yet serving (path, model)
        self.num_preemptions = 0
        self.speculative = SpeculativeConfig.parse(args.speculative_config)  # None: no drafts
        # whether a step drafts: measured per batch size, or the config's fixed rule
        self.draft_policy = None if self.speculative is None else DraftPolicy(self.speculative.disable_by_batch_size)
        self.spec_decode = SpecDecodeCounts()
        # "suffix" drafts also come from earlier requests' outputs, kept here per tenant
        self.suffix_cache = None if self.speculative is None else \
            SuffixCache(self.speculative.suffix_decoding_max_cached_requests,
                        self.speculative.suffix_decoding_max_cached_tokens)
        # Each step's prefix-cache changes, published for cache-aware routers (None: off); on
        # rank 0 only, whose scheduler is the one that decides
        self.kv_events = ZmqEventPublisher(kv_events, args.data_parallel_rank) \
            if kv_events.enabled and self.tp.rank == 0 else None

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (a no-op on one rank) and the grammar compiler
        processes. Idempotent; the core steps no more after it."""
        told = True
        try:
            if self.kv_events is not None:
                self.kv_events.close()
            self.grammars.close()
            if self.tp.size > 1 and not self.runner.closed:
                told = self.runner.close()
        finally:
            self._stop_workers(wait=told)
            self._leave_group()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _leave_group(self) -> None:
        """The group is the process's: a one-rank engine beside another leaves it be, and a
        second close must not leave the group a later engine has joined since."""
        if self._in_group:
            self._in_group = False
            parallel.leave()

    def _stop_workers(self, wait: bool = True) -> None:
        """`wait`: give them time to exit on their own (they were told to); else kill them now."""
        if self.workers is not None:
            self.workers.stop(wait)
            self.workers = None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> LoRAAdapter | None:
        """check_request (below) against this core: reads only what a step never changes, so any
        thread may call it while a step runs."""
        return check_request(self.config, self.args, self.loras, prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    checked: bool = False) -> None:
        """Queue a request; raises ValueError (SamplingParamError with .param) if it can never run
        (check_request) or its id is taken. SamplingParams generate (max_tokens 0: the prompt
        alone, for its logprobs); PoolingParams make a prefill-only request that ends with its
        pooled hidden state. `checked`: check_request passed for it already (a front ran it in a
        worker thread), so its scans of the prompt are not made twice; the adapter it names is
        looked up again all the same, since it may have been unloaded in between.

        All or nothing: every check, and everything that can raise (the grammar's matcher
        too), comes before the scheduler takes the request, so a refused request leaves no
        trace (a half-added one would be stepped with no record and kill the engine)."""
        if request_id in self.requests:
            raise SamplingParamError("request_id", f"A request with id {request_id!r} is already running.")
        if self.is_sleeping:
            raise SamplingParamError("model", "The engine is sleeping: wake it up first.")
        lora = find_adapter(self.loras, params.lora_name) if checked else self.check_request(prompt_token_ids, params)
        # An adapter's KV differs from the base model's: its id roots its blocks' chain and identity.
        lora_salt = "" if lora is None else f"\0lora-{lora.lora_id}"
        lora_id = 0 if lora is None else lora.lora_id
        if not isinstance(params, SamplingParams):
            request = Request(request_id, list(prompt_token_ids), 0, prefix_hit_limit=params.pooling.prefix_hit_limit,
                              cache_salt=lora_salt, lora_id=lora_id, hash_extra_keys=self._hash_extra_keys(lora, ""))
            self._add(EngineRequest(request, params, None, pooler=Pooler(params.pooling, len(prompt_token_ids)),
                                    lora=lora))
            return
        # none asked: to the end of the context
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_token_ids)
        request = Request(
            request_id,
            list(prompt_token_ids),
            max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            # The request's one stop set, EOS ids included: the sampler masks the same set.
            stop_token_ids=params.stop_token_set(self.config.eos_token_ids),
            prefix_hit_limit=params.prefix_hit_limit,
            cache_salt=(params.cache_salt or "") + lora_salt,
            priority=params.priority,
            lora_id=lora_id,
            hash_extra_keys=self._hash_extra_keys(lora, params.cache_salt or ""),
        )
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        # Made before the scheduler takes the request: the matcher is what can still fail.
        matcher = None if params.structured_output is None else self.grammars.matcher(params.structured_output)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = PromptLogprobs(list(prompt_token_ids), params.prompt_logprobs_start, params.prompt_logprobs)
        drafter = None
        if self.speculative is not None and self.speculative.method == "suffix":
            drafter = SuffixDrafter(self.speculative, self.suffix_cache, (lora_id, request.cache_salt))
        elif self.speculative is not None:
            drafter = NgramDrafter(self.speculative)
        self._add(EngineRequest(request, params, generator, matcher, prompt_logprobs=prompt_logprobs, lora=lora,
                                drafter=drafter))

    def _hash_extra_keys(self, lora: LoRAAdapter | None, salt: str) -> tuple | None:
        """An adapter's request's extra keys for vLLM's sha256_cbor prefix keys (`vllm_extra_keys`,
        with the path the adapter was loaded from). None otherwise: the allocator keys a salt
        alone itself, and Python's hash takes the adapter from the salt."""
        if lora is None or self.args.prefix_caching_hash_algo != PrefixHashAlgo.SHA256_CBOR:
            return None
        return vllm_extra_keys(lora.name, lora.path, salt)

    def _add(self, row: EngineRequest) -> None:
        if row.lora is not None:
            try:  # reads its weights again if they were dropped: the last thing that can fail
                self.loras.acquire(row.lora.name)
            except LoRAError as exc:
                raise SamplingParamError("model", str(exc), exc.status) from None
        try:
            self.scheduler.add(row.seq)
        except ValueError as e:
            if row.lora is not None:
                self.loras.release(row.lora)
            raise SamplingParamError("prompt", str(e)) from None
        self.requests[row.request_id] = row

    def _forget(self, request_id: str) -> None:
        """A request ended: its record goes, and its hold on its adapter; its drafter learns its output."""
        row = self.requests.pop(request_id)
        if row.lora is not None:
            self.loras.release(row.lora)
        if row.drafter is not None:
            row.drafter.finished(row.token_ids[row.num_prompt_tokens:])

    # --- the weights' life cycle: the engine's owner calls these; sleep and swap need it idle ---

    def sleep(self, level: int) -> int:
        """Free the KV cache (level 1) and the weights (level 2; level 1 on CUDA moves them to host
        memory); the prefix cache is emptied, since its KV is gone. Returns the bytes the device
        (CUDA) or the process (CPU: its resident set) holds less. Steps wait for wake_up."""
        self._check_weights_op("Sleep mode")
        if level not in (1, 2):
            raise ValueError(f"The sleep level is 1 or 2, got {level}.")
        device = self.config.device
        before = memory.in_use(device)
        assert self.scheduler.allocator.reset_prefix_cache(), "no request holds blocks"
        self.runner.sleep(level)
        memory.give_back(device)
        return before - memory.in_use(device)

    def wake_up(self, tags: set[str] | None = None) -> None:
        """Bring back what sleep freed (`tags`: SleepTag values, "weights", "kv_cache"; None: both).
        ValueError for a tag that is none of them."""
        unknown = (tags or set()) - set(SleepTag)
        if unknown:
            raise ValueError(f"Unknown wake-up tags {sorted(unknown)}; the tags are "
                             f"{' and '.join(SleepTag)}.")
        self.runner.wake_up({SleepTag(tag) for tag in tags} if tags else set(SleepTag))

    @property
    def is_sleeping(self) -> bool:
        return bool(self.runner.asleep)

    def asleep(self) -> list[str]:
        """What sleeps now (SleepTag values), for a front that reads it between two steps."""
        return sorted(self.runner.asleep)

    def stage_weights(self, path: str) -> None:
        """Load the weights at `path` into a model of their own, kept for `swap_staged_weights`
        (any thread: the serving model is untouched; a later stage replaces it). ValueError for
        another architecture or shapes; whatever the loader raises for a path it cannot read."""
        self._check_weights_op("Updating weights", idle=False)
        self._staged = (path, self.runner.load_replacement(path))

    def swap_staged_weights(self) -> EngineArgs:
        """Serve the staged model from the next step on; the prefix cache is emptied (its KV came
        from the old weights). Returns the settings as they run now (the new path)."""
        assert self._staged is not None, "stage_weights first"
        assert not self.has_unfinished() and self.scheduler.allocator.reset_prefix_cache()
        (path, model), self._staged = self._staged, None
        self.runner.swap_in(model, path)
        self.args = replace(self.args, model=path)
        return self.args

    def _check_weights_op(self, what: str, idle: bool = True) -> None:
        """ValueError unless `what` can run now: on one rank, and (`idle`) with no request live."""
        if self.tp.size > 1:
            raise ValueError(f"{what} is not supported under tensor parallelism yet.")
        if idle and self.has_unfinished():
            raise ValueError(f"{what} needs every request to have ended first.")

    # --- LoRA adapters: only the engine's owner calls these, between steps ----------------------

    def load_lora(self, name: str, path: str, weights: LoRAWeights, replace: bool = False) -> LoRAAdapter:
        """Register an adapter read by `self.loras.read(path)` (which may run in any thread);
        LoRAError if LoRA is off or the name is taken (with `replace`, an adapter of that name is
        unloaded first: LoRAError, and nothing changed, while requests use it)."""
        if self.loras is None:
            raise LoRAError("LoRA adapters need a server started with --enable-lora.")
        if replace:
            self.unload_lora(name)
        return self.loras.add(name, path, weights)

    def unload_lora(self, name: str) -> LoRAAdapter:
        """Forget an adapter; LoRAError: 404 if unknown, 400 while requests use it."""
        if self.loras is None:
            raise LoRAError(f"The LoRA adapter `{name}` does not exist.", status=404)
        return self.loras.remove(name)

    def _lora_usage(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters of running requests, and of waiting ones (vLLM's lora_requests_info)."""
        if self.loras is None:  # stats are read after every step: no walk over the requests for nothing
            return (), ()
        running, waiting = set(), set()
        for row in self.requests.values():
            if row.lora is not None:
                (running if row.seq.status is RequestStatus.RUNNING else waiting).add(row.lora.name)
        return tuple(sorted(running)), tuple(sorted(waiting))

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> StepOutput | None:
        """End a request now and free its blocks; None if it is unknown or already finished."""
        request = self.scheduler.abort(request_id, reason)
        if request is None:
            return None
        self._forget(request_id)
        return self._output(request, [], None, True)

    def step(self) -> list[StepOutput]:
        outputs = self._step()
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache gained and lost since the last call to the publisher, as
        one batch (none when nothing changed); never waits on it."""
        if self.kv_events is None:
            return
        raw = self.scheduler.allocator.take_events()
        if raw:
            names = {} if self.loras is None else {a.lora_id: name for name, a in self.loras.adapters.items()}
            self.kv_events.publish(event_batch(raw, self.args.block_size, self.args.data_parallel_rank, names))

    def _step(self) -> list[StepOutput]:
        started, num_running = time.perf_counter(), self.scheduler.num_running
        if self.draft_policy is not None and self.draft_policy.drafts(num_running):
            self._propose_drafts()
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if not sched.scheduled:
            return []
        scheduled = [self.requests[entry.request.request_id] for entry in sched.scheduled]
        wants_hidden = any(row.wants_hidden for row in scheduled)
        lora_slots = None if self.loras is None else self.runner.lora_slots.assign([row.lora for row in scheduled])
        out = self.runner.execute(sched, keep_hidden=wants_hidden, lora_slots=lora_slots)
        sampling = [(row, entry) for row, entry in zip(scheduled, sched.scheduled) if entry.needs_sample]
        rows = [row for row, _ in sampling]
        entries = [entry for _, entry in sampling]
        runs, run_logprobs = self._sample_in_groups(out.sample_hidden, rows, entries)
        if wants_hidden:  # after the sampled rows: tensor-parallel workers project those first
            self._take_hidden(sched, scheduled, out.hidden)
        num_before = [len(row.token_ids) for row in rows]
        picks, sampled = iter(runs), []
        for entry in sched.scheduled:  # the scheduler takes a token, or a verified run for a decode with drafts
            run = next(picks) if entry.needs_sample else [-1]
            sampled.append(run if entry.draft_token_ids else run[0])
        finished = self.scheduler.update(sched, sampled)
        finished_ids = {r.request_id for r in finished}
        outputs = []
        for row, logprobs, before in zip(rows, run_logprobs, num_before):
            # What the scheduler appended: a stop token or the length limit may cut a verified run.
            tokens = row.token_ids[before:]
            if row.matcher is not None:
                # A grammar that ended without the scheduler's say (its stop token was ignored, or
                # it refused a token) ends the request there too; abort frees its blocks at once.
                ended = next((i for i, token in enumerate(tokens) if not accept(row.matcher, token)), None)
                if ended is not None:
                    tokens = tokens[:ended + 1]
                    if row.request_id not in finished_ids:
                        self.scheduler.abort(row.request_id, FinishReason.STOP)
                        finished_ids.add(row.request_id)
            outputs.append(self._output(row.seq, tokens, None if logprobs is None else logprobs[:len(tokens)],
                                        row.request_id in finished_ids, row))
        for row, entry in zip(scheduled, sched.scheduled):
            if not entry.needs_sample and row.request_id in finished_ids:  # prefill only: its prompt is done
                outputs.append(self._output(row.seq, [], None, True, row))
        for request_id in finished_ids:
            self._forget(request_id)
        if self.draft_policy is not None and all(entry.needs_sample and entry.num_new_tokens == len(
                entry.draft_token_ids) + 1 for entry in sched.scheduled):
            # a decode step (no prompt in it): what drafting was worth at this batch size, or not
            # drafting (a step no request had drafts for is one)
            drafted = any(entry.draft_token_ids for entry in sched.scheduled)
            num_tokens = sum(len(row.token_ids) - before for row, before in zip(rows, num_before))
            self.draft_policy.measured(num_running, drafted, num_tokens, time.perf_counter() - started)
        return outputs

    def _propose_drafts(self) -> None:
        """Give each decoding request its drafts for this step (the step's policy drafts)."""
        for row in self.requests.values():
            seq = row.seq
            if row.drafter is not None and seq.status is RequestStatus.RUNNING \
                    and seq.num_computed_tokens == len(seq.token_ids) - 1:
                seq.draft_token_ids = row.drafter.propose(seq.token_ids)

    def _sample_in_groups(self, hidden: torch.Tensor, rows: list[EngineRequest],
                          entries: list) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """`_sample` for each group of requests whose rows the runner projects at once
        (ModelRunner.logits_rows), each group's logits from its rows of `hidden`
        (ModelOutput.sample_hidden) once the group before has been sampled."""
        runs, run_logprobs, first = [], [], 0
        sizes = [entry.num_sample_rows for entry in entries]
        for group in logit_groups(sizes, self.runner.logits_rows):
            num_rows = sum(sizes[group.start:group.stop])
            logits = self.runner.step_logits(hidden[first:first + num_rows])
            group_runs, group_logprobs = self._sample(logits, rows[group.start:group.stop],
                                                      entries[group.start:group.stop])
            runs += group_runs
            run_logprobs += group_logprobs
            first += num_rows
        return runs, run_logprobs

    def _sample(self, logits: torch.Tensor, rows: list[EngineRequest],
                entries: list) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Each sampling request's new tokens and their logprobs (None where none were asked): one
        token, or a verified run for a decode with drafts (trillm/engine/verification.py)."""
        positions = sampling_rows(rows, entries)
        constrained, first = [], 0
        for row, entry in zip(rows, entries):
            if row.matcher is not None:
                constrained.append((first, row.matcher, entry.draft_token_ids))
            first += 1 + len(entry.draft_token_ids)
        if constrained:
            self.grammars.mask(logits, constrained)
        streams = SeededStreams(rows, entries)
        sampled = self.sampler.sample(logits, SamplingBatch.of(positions), scratch=True)  # the step's own
        runs, run_logprobs, first = [], [], 0
        for row, entry in zip(rows, entries):
            drafts = entry.draft_token_ids
            run = verified_run(drafts, sampled.token_ids[first:first + len(drafts) + 1])
            if drafts:
                self.spec_decode.count(len(drafts), len(run) - 1)
                row.drafter.accepted(len(drafts), len(run) - 1)
                streams.keep(row, len(run))
            logprobs = sampled.logprobs[first:first + len(run)]
            runs.append(run)
            run_logprobs.append(None if logprobs[0] is None else logprobs)
            first += len(drafts) + 1
        return runs, run_logprobs

    def _take_hidden(self, sched: SchedulerOutput, scheduled: list[EngineRequest], hidden: torch.Tensor) -> None:
        """Hand each chunk's hidden states to the requests that gather from them."""
        wanted = []
        offset = 0
        for row, entry in zip(scheduled, sched.scheduled):
            first, count = entry.num_computed_tokens, entry.num_new_tokens
            if row.prompt_logprobs is not None:
                wanted.append((row.prompt_logprobs, offset, row.prompt_logprobs.rows_wanted(first, count)))
            if row.pooler is not None:
                row.pooler.take(first, hidden[offset:offset + count])
            offset += count
        if any(rows for _, _, rows in wanted):
            fill_prompt_logprobs(wanted, functools.partial(self.runner.logits_of_rows, hidden))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        allocator = self.scheduler.allocator
        total = self.runner.num_kv_blocks
        running_loras, waiting_loras = self._lora_usage()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=total,
            num_free_blocks=allocator.num_free_blocks,
            num_used_blocks=allocator.num_used_blocks,
            num_cached_blocks=allocator.num_cached_blocks,
            kv_cache_usage=allocator.num_used_blocks / total,
            prefix_cache_queries=allocator.prefix_cache_queries * self.args.block_size,
            prefix_cache_hits=allocator.prefix_cache_hits * self.args.block_size,
            num_preemptions=self.num_preemptions,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            num_lora_adapters=0 if self.loras is None else len(self.loras.adapters),
            lora_memory_bytes=0 if self.loras is None else self.loras.nbytes,
            spec_decode_num_drafts=self.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(self.spec_decode.accepted_per_position),
            kv_events_dropped_batches=0 if self.kv_events is None else self.kv_events.dropped,
        )

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.allocator.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def _output(self, request: Request, tokens, logprobs, finished: bool, row: EngineRequest | None = None) -> StepOutput:
        """`row`: the request's record, whose finished prompt logprobs or pooled vector go out now."""
        prompt_logprobs = pooled = None
        if row is not None and row.prompt_logprobs is not None and row.prompt_logprobs.done:
            prompt_logprobs, row.prompt_logprobs = row.prompt_logprobs.entries, None
        if row is not None and row.pooler is not None and row.pooler.result is not None:
            pooled, row.pooler = row.pooler.result, None
        return StepOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            stop_token_id=request.stop_token_id if finished else -1,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )


def check_request(config: ModelConfig, args: EngineArgs, loras: LoRARegistry | None, prompt_token_ids: list[int],
                  params: SamplingParams | PoolingParams) -> LoRAAdapter | None:
    """The adapter the request names (None: none), or ValueError (SamplingParamError with
    .param) for a request that can never run, by itself:
    an empty prompt, a token id outside the vocabulary, a prompt or prompt + max_tokens beyond
    the context, a priority without the priority policy, an adapter not loaded. Reads only
    what a step never changes (the model's config, the settings, the adapters' registry): a
    front refuses such a request at once, not after the step it would wait for (and tells
    add_request so: `checked`)."""
    if not prompt_token_ids:
        raise SamplingParamError("prompt", "The prompt is empty.")
    vocab_size = config.hf_config.vocab_size
    sampling = isinstance(params, SamplingParams)
    checked = [("prompt", prompt_token_ids)]
    if sampling:
        checked += [("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)]
    for param, ids in checked:
        if any(not 0 <= t < vocab_size for t in ids):
            raise SamplingParamError(param, f"Token ids in {param} must be in [0, {vocab_size}).")
    if len(prompt_token_ids) >= config.max_model_len:
        raise SamplingParamError(
            "prompt",
            f"The prompt is {len(prompt_token_ids)} tokens long; this model's context is "
            f"{config.max_model_len} tokens, which must hold the prompt and at least one new token.",
        )
    if sampling and params.priority and args.scheduling_policy != SchedulingPolicy.PRIORITY:
        raise SamplingParamError("priority", "priority needs a server started with --scheduling-policy priority.")
    adapter = find_adapter(loras, params.lora_name)
    asked = params.max_tokens if sampling else None  # None: to the end of the context
    if asked is not None and len(prompt_token_ids) + asked > config.max_model_len:
        # Refused, not clamped: a client asking for more than fits should hear so.
        raise SamplingParamError(
            "max_tokens",
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {len(prompt_token_ids) + asked} tokens ({len(prompt_token_ids)} in "
            f"the prompt, {asked} in the completion). Reduce the prompt or max_tokens.",
        )
    return adapter


def find_adapter(loras: LoRARegistry | None, name: str | None) -> LoRAAdapter | None:
    """The adapter a request names, checked (not yet held: _add holds it)."""
    if name is None:
        return None
    if loras is None:
        raise SamplingParamError("model", f"The LoRA adapter `{name}` does not exist: this server runs without "
                                          "--enable-lora.", status=404)
    try:
        return loras.get(name)
    except LoRAError as exc:  # unloaded since the server checked the name: still a 404
        raise SamplingParamError("model", str(exc), exc.status) from None


