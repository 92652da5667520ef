"""ModelRunner: owns the model and the paged KV cache, and turns one SchedulerOutput into logits.

The scheduler decides who runs and which blocks hold their context; the runner only lays that out
as flat tensors (one torch.tensor per field, built from flat Python lists) and runs one forward.
Logits are computed only for the requests that sample this step: a prefill chunk that does not
reach the end of its prompt needs none. On CUDA, pure-decode steps replay CUDA graphs
(trillm/model/cuda_graphs.py); every other step runs eagerly.
"""
from __future__ import annotations

import enum
import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from trillm.config import EngineArgs, LoadFormat, default_kv_cache_memory
from trillm.heap import TrimAfterPrompts
from trillm.kernels.attention_metadata import AttentionMetadata
from trillm.kernels.cache import cache_shape, kv_block_bytes
from trillm.model.cuda_graphs import DecodeGraphs, use_cuda_graphs
from trillm.model.llama import Linear, LlamaForCausalLM, head_dim_of
from trillm.model.loader import load_model, pack_linear_weights, resolve_device
from trillm.model.lora import LoRASlots, attach_lora
from trillm.model.parallel import SINGLE, TensorParallel, rank_cpus
from trillm.sched_ext import SchedulerOutput

log = logging.getLogger(__name__)
# the bytes of logits one CPU step holds at a time (ModelRunner.logits_rows)
LOGITS_BYTES = 16 << 20
# the prompt tokens whose freed temporaries are worth a trim of the C heap (TrimAfterPrompts)
TRIM_AFTER_PROMPT_TOKENS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SleepTag(enum.StrEnum):
    """What sleep mode frees and a wake-up brings back (vLLM's wake-up tags)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


@dataclass(frozen=True)
class StepInputs:
    """One forward's inputs as plain lists, one entry per scheduled request: what rank 0 sends
    the tensor-parallel workers each step (each rank lays them out as tensors itself).

    Request b computes `chunks[b]` at positions num_computed_tokens[b] onwards; its block table
    covers them; the last num_sample_rows[b] rows of its chunk get logits (0: none, 1: its last
    token's, more: a decode's and its drafts')."""

    chunks: list[list[int]]
    block_tables: list[list[int]]
    num_computed_tokens: list[int]
    num_sample_rows: list[int]
    lora_slots: list[int] | None = None  # each request's LoRA slot (-1: none); None: no adapter runs


@dataclass(frozen=True)
class LogitRows:
    """Rank 0's word to the tensor-parallel workers that it projects these rows of the step's
    hidden states, beyond the sampled rows every rank projects on its own (prompt logprobs,
    teacher forcing): each rank holds a share of the vocabulary, so every rank must project
    the same rows for the logits' gather."""

    rows: list[int]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64: the rows that get logits (each sampling chunk's last, and its drafts')
    lora_slots: torch.Tensor | None = None  # [T] int64: each row's LoRA slot (-1: none); None: none at all


@dataclass
class ModelOutput:
    """One step's results: `sample_hidden` [N, hidden], the final hidden states of the N rows
    that sample (a row per request, and one per draft of a decode that verifies drafts), in
    schedule order, whose logits `ModelRunner.step_logits` gives; `hidden` [T, hidden], the
    final hidden states of every computed row (chunk after chunk, in schedule order) when the
    step was asked to keep them, else None. Both are valid until the next step (on CUDA graphs,
    `hidden` is the graph's own output)."""

    sample_hidden: torch.Tensor
    hidden: torch.Tensor | None


class ModelRunner:
    def __init__(self, args: EngineArgs, tp: TensorParallel = SINGLE):
        """`tp`: this rank's place in a tensor-parallel group (rank 0 drives the steps; the
        others run `serve_steps`). Every rank builds its shard and its share of the KV cache."""
        self.args = args
        self.tp = tp
        on_cpu = resolve_device(args.device).type == "cpu"
        if tp.size > 1 and args.tp_cpu_binding and on_cpu:
            os.sched_setaffinity(0, rank_cpus(tp))  # before any thread pool starts
        if on_cpu:
            # Loading's torch ops on the cores this process may run on, and no more threads than
            # those: torch sized its pool when it was imported, before a rank or a data-parallel
            # replica was pinned to its share, and its OpenMP workers spin at each op's barrier
            # for a core that one of them holds.
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        loaded = load_model(args, tp)
        self.model, self.config, self.tokenizer = self._prepared(loaded.model), loaded.config, loaded.tokenizer
        if on_cpu:
            torch.set_num_threads(args.num_threads)  # the kernels' own threads were set as it was built
        self.lora_slots: LoRASlots | None = None  # the model's LoRA adapter slots (trillm/model/lora.py)
        self.asleep: set[SleepTag] = set()  # what sleep mode freed (empty: serving)
        self.block_size = args.block_size
        # The cache's layout, kept: a level-2 sleep drops the model, and the cache may wake first
        self._kv_heads, self._kv_dtype = self.model.num_kv_heads, self.model.kernels.kv_cache_dtype
        self.decode_graphs: DecodeGraphs | None = None  # captured once the KV cache exists
        self._logits: torch.Tensor | None = None  # the CPU steps' logits buffer (step_logits)
        # glibc's heap on CPU; CUDA's caching allocator keeps what it keeps
        self._heap_trim = TrimAfterPrompts(TRIM_AFTER_PROMPT_TOKENS) if self.config.device.type == "cpu" else None
        self.closed = False
        # Tests set this to fail a step from inside the model's turn (a device error, say):
        # called with the SchedulerOutput at the start of every execute. None in production.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        # Every rank must hold the same blocks: the fewest any rank's budget holds.
        self.num_kv_blocks = args.num_kv_blocks or tp.minimum(self._num_blocks_in_budget())
        if self.num_kv_blocks < 1:
            raise ValueError("The KV cache budget holds no block: raise the memory budget or lower block_size.")
        if tp.rank == 0:
            log.info("KV cache: %d blocks of %d tokens, %.2f GiB", self.num_kv_blocks, self.block_size,
                     self.num_kv_blocks * self.block_bytes * tp.size / (1 << 30))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = self._allocate_kv_cache(self.num_kv_blocks)
        self._serve(self.model)

    def _prepared(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """A loaded model made ready to run: its linear weights packed where the family packs them,
        and its layers fused for decode steps where the family and the model allow it."""
        if model.kernels.packs_linear_weights:
            pack_linear_weights(model)
        model.model.fuse_layers()
        return model

    def _serve(self, model: LlamaForCausalLM) -> None:
        """Make `model` the one steps run: its LoRA slots (empty: adapters are copied in as steps
        need them) and, on CUDA, its decode graphs over the KV cache, captured after the slots."""
        self.model = model
        if self.args.enable_lora:
            self.lora_slots = attach_lora(model, self.args.max_loras, self.args.max_lora_rank)
        self.decode_graphs = None
        # A graph would capture the collectives of one process group's state: eager under TP.
        if self.tp.size == 1 and use_cuda_graphs(self.config.device, self.args.enforce_eager, self.args.attention_backend):
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                min(self.args.max_num_seqs, self.config.max_num_batched_tokens),  # the largest decode batch
                self.config.max_model_len,
                self.block_size,
            )

    # --- the weights' life cycle: only the engine's owner calls these, with no request live ---

    def load_replacement(self, path: str) -> LlamaForCausalLM:
        """The weights at `path` (an HF directory or a GGUF file) in a new model, ready to `swap_in`;
        the serving model is untouched, so this may run in any thread while steps go on.
        ValueError (before any weight is read) when `path` holds another architecture or other
        shapes; the loader's own errors for a path that cannot be read."""
        assert self.tp.size == 1, "updating weights under tensor parallelism is refused before this"
        args = replace(self.args, model=path, load_format=LoadFormat.AUTO)
        return self._prepared(load_model(args, same_as=self.config.hf_config).model)

    def swap_in(self, model: LlamaForCausalLM, path: str) -> None:
        """Serve `model` (from load_replacement) from the next step on; the old one is dropped."""
        self.args = replace(self.args, model=path, load_format=LoadFormat.AUTO)
        self._serve(model)

    def sleep(self, level: int) -> None:
        """Free the KV cache and, at level 2, the weights; at level 1 on CUDA the weights move to
        host memory (on CPU they stay). Whatever the cache held is gone: the caller resets the
        prefix cache. Sleeping again may go deeper (level 1, then 2)."""
        assert level in (1, 2)
        self.decode_graphs = None  # they hold the cache and the weights
        self.kv_caches = None
        self.asleep.add(SleepTag.KV_CACHE)
        if self.model is not None:
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.lora = None
        self.lora_slots = None
        if level == 2:
            self.model = None
            self.asleep.add(SleepTag.WEIGHTS)
        elif self.config.device.type == "cuda" and self.model is not None:
            self.model.to("cpu")
            self.asleep.add(SleepTag.WEIGHTS)

    def wake_up(self, tags: set[SleepTag]) -> None:
        """Bring back what `tags` names of what sleeps: "weights" (read again from their path
        after a level-2 sleep, moved back to the device after level 1 on CUDA) and "kv_cache"
        (empty). Once nothing sleeps, the model serves again (its slots, its graphs)."""
        if SleepTag.WEIGHTS in tags & self.asleep:
            if self.model is None:
                self.model = self._prepared(load_model(self.args, self.tp).model)
            else:
                self.model.to(self.config.device)
            self.asleep.discard(SleepTag.WEIGHTS)
        if SleepTag.KV_CACHE in tags & self.asleep:
            self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
            self.asleep.discard(SleepTag.KV_CACHE)
        if not self.asleep:
            self._serve(self.model)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V over all layers (this rank's heads)."""
        cfg = self.config.hf_config
        return kv_block_bytes(cfg.num_hidden_layers, self.block_size, self._kv_heads, head_dim_of(cfg), self._kv_dtype)

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, K and V, num_blocks, block_size, Hk, row_width] (trillm/kernels/cache.py: D, or
        D + 2 for an int8 cache's scales)."""
        cfg = self.config.hf_config
        return cache_shape(cfg.num_hidden_layers, num_blocks, self.block_size, self._kv_heads, head_dim_of(cfg),
                           self._kv_dtype)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each [num_blocks, block_size, Hk, row_width] and contiguous, carved
        from one allocation (_kv_cache_shape). Zeroed: attention masks unused slots, but 0 * NaN from stale memory is NaN.
        On CPU the allocation is an anonymous mapping, zero by the kernel's promise, whose pages
        become resident only once a block is written: a server holds the memory its requests
        use, not its whole budget (torch.zeros would write, and so keep, every page)."""
        shape = self._kv_cache_shape(num_blocks)
        dtype = self._kv_dtype
        if self.config.device.type == "cpu":
            pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
            cache = torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps `pages` alive
        else:
            cache = torch.zeros(shape, dtype=dtype, device=self.config.device)
        return [(layer[0], layer[1]) for layer in cache]

    def _num_blocks_in_budget(self) -> int:
        if self.config.device.type == "cuda":
            return self._profile_free_cuda_bytes() // self.block_bytes
        budget = self.args.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_memory()
        # Each rank holds its heads' part of every block, so each takes its part of the budget;
        # more blocks than max_num_seqs sequences of the full context fill are never all in use.
        return min(budget // self.tp.size // self.block_bytes,
                   _cdiv(self.args.max_num_seqs * self.config.max_model_len, self.block_size))

    def _profile_free_cuda_bytes(self) -> int:
        """GPU bytes left for the KV cache: the share gpu_memory_utilization of the device, less
        what is in use now (weights, CUDA context, other processes) and the activation peak of
        the largest step (max_num_batched_tokens tokens over up to max_num_seqs sequences, each
        sampled, so the logits of max_num_seqs rows are counted too)."""
        args = self.args
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = max(min(args.max_num_seqs, num_tokens), _cdiv(num_tokens, self.config.max_model_len))
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        num_blocks = [_cdiv(n, self.block_size) for n in lengths]
        starts = [sum(num_blocks[:i]) for i in range(num_seqs)]
        tables = [list(range(start, start + n)) for start, n in zip(starts, num_blocks)]
        kv_caches = self._allocate_kv_cache(sum(num_blocks))
        batch = self.prepare(StepInputs([[0] * n for n in lengths], tables, [0] * num_seqs, [1] * num_seqs))
        torch.cuda.reset_peak_memory_stats(self.config.device)
        self.compute_logits(self._forward(batch, kv_caches)[batch.sample_rows])
        torch.cuda.synchronize(self.config.device)
        peak = torch.cuda.max_memory_allocated(self.config.device)
        del kv_caches, batch
        torch.cuda.empty_cache()
        activations = peak - torch.cuda.memory_allocated(self.config.device)
        free, total = torch.cuda.mem_get_info(self.config.device)
        return int(total * args.gpu_memory_utilization) - (total - free) - activations

    def execute(self, sched: SchedulerOutput, keep_hidden: bool = False, lora_slots: list[int] | None = None) -> ModelOutput:
        """sched: a SchedulerOutput. `keep_hidden`: also return every row's final hidden state
        (for prompt logprobs and pooling). `lora_slots`: each scheduled request's LoRA slot
        (LoRASlots.assign), or None when none uses an adapter."""
        if self.fault_hook is not None:
            self.fault_hook(sched)
        chunks, block_tables, starts, samples = [], [], [], []
        for entry in sched.scheduled:
            r, start, drafts = entry.request, entry.num_computed_tokens, entry.draft_token_ids
            own = entry.num_new_tokens - len(drafts)
            assert not entry.needs_sample or start + own == len(r.token_ids), \
                "a request samples only when its chunk reaches its last token"
            chunks.append(r.token_ids[start:start + own] + drafts if drafts else r.token_ids[start:start + own])
            block_tables.append(r.block_table)
            starts.append(start)
            samples.append(entry.num_sample_rows)
        inputs = StepInputs(chunks, block_tables, starts, samples, lora_slots)
        batch, hidden = self._run(inputs)
        hidden = hidden[: sched.total_num_tokens]
        return ModelOutput(hidden[batch.sample_rows], hidden if keep_hidden else None)

    @property
    def logits_rows(self) -> int | None:
        """The most sampled rows the engine asks `step_logits` for at once (a request's rows are
        never split, so one request's may be more), None for all of a step's: on one CPU rank,
        as many as LOGITS_BYTES hold. A 262k vocabulary's logits are 1 MiB a row, and a step
        that verifies drafts samples dozens of rows; from 16 rows on, the vocabulary projection
        computes rather than streams its weights, so a smaller group costs no time. Elsewhere
        every rank projects a step's sampled rows together (serve_steps)."""
        if self.config.device.type != "cpu" or self.tp.size > 1:
            return None
        return max(1, LOGITS_BYTES // (4 * self.config.hf_config.vocab_size))

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits for rows of a step's `ModelOutput.sample_hidden`: once for all of them
        where `logits_rows` is None; on one CPU rank into a buffer the steps share, valid until
        the next call. A fresh [rows, vocab] each call would be mapped and faulted in anew
        (glibc maps an allocation that large, and one as large as the last it freed).

        The buffer is an anonymous mapping of its own, which grows by doubling: its pages are
        resident once a call has written them, and an outgrown buffer's mapping goes back to the
        system whole. From glibc's heap, each buffer outgrown as the rows rose (drafts add rows
        a few at a time) stayed behind as a hole that no later one fit in."""
        if self.logits_rows is None or hidden.shape[0] == 0:
            return self.compute_logits(hidden)
        rows, vocab = hidden.shape[0], self.config.hf_config.vocab_size
        if self._logits is None or self._logits.shape[0] < rows:
            capacity = max(rows, 2 * self._logits.shape[0] if self._logits is not None else rows)
            self._logits = None  # unmapped before its successor is made
            pages = mmap.mmap(-1, capacity * vocab * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._logits = torch.frombuffer(pages, dtype=torch.float32).view(capacity, vocab)  # keeps `pages`
        return self.compute_logits(hidden, self._logits[:rows])

    def _run(self, inputs: StepInputs) -> tuple[ModelInput, torch.Tensor]:
        """One forward on every rank: rank 0 sends the inputs to the workers first."""
        if self.tp.rank == 0 and self.tp.size > 1:
            self.tp.broadcast(inputs)
        batch = self.prepare(inputs)
        hidden = self._forward(batch, self.kv_caches)
        if self._heap_trim is not None:  # rows that sample are decodes', but for a prompt's last
            self._heap_trim.step(sum(map(len, inputs.chunks)) - sum(inputs.num_sample_rows))
        return batch, hidden

    def logits_of_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits of `rows` of this step's hidden states `hidden` [T, hidden]; on rank 0 of
        a tensor-parallel group the workers are told to project the same rows (LogitRows)."""
        if self.tp.size > 1:
            self.tp.broadcast(LogitRows(rows))
        return self.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)])

    def serve_steps(self) -> None:
        """A tensor-parallel worker's whole life: run every step rank 0 sends, its sampled rows'
        logits gathered, and every further projection of that step's rows it announces, until
        rank 0 sends None (close) or a collective fails (rank 0 died)."""
        assert self.tp.rank > 0
        hidden = None
        while (message := self.tp.broadcast()) is not None:
            if isinstance(message, LogitRows):
                self.compute_logits(hidden[torch.tensor(message.rows, dtype=torch.int64, device=hidden.device)])
                continue
            batch, hidden = self._run(message)
            self.compute_logits(hidden[batch.sample_rows])

    def close(self) -> bool:
        """On rank 0 of a tensor-parallel group: tells the workers to stop. Idempotent. False
        when they could not be told (one is gone or hung: the broadcast failed)."""
        if self.tp.rank == 0 and self.tp.size > 1 and not self.closed:
            self.closed = True
            try:
                self.tp.broadcast(None)
            except RuntimeError:
                return False
        return True

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab] of final hidden states [rows, hidden]; no rows, no work.
        `out`: where the quantized CPU kernel may write them (LlamaForCausalLM.compute_logits)."""
        if hidden.shape[0] == 0:
            return torch.empty(0, self.config.hf_config.vocab_size, dtype=torch.float32, device=hidden.device)
        return self.model.compute_logits(hidden, out).float()

    @torch.inference_mode()
    def teacher_forced_logits(self, token_ids: list[int], chunk: int = 512) -> torch.Tensor:
        """fp32 logits [len(token_ids), vocab] at every position of one sequence (what the model
        predicts after each prefix), in prefill chunks. For offline measurement: it writes the KV
        cache's first blocks, so it must not run beside live requests."""
        table = list(range(_cdiv(len(token_ids), self.block_size)))
        assert len(table) <= self.num_kv_blocks, "the KV cache is too small for this sequence"
        logits = []
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            # No sampled row: every row's logits, projected as the rows of one LogitRows.
            _, hidden = self._run(StepInputs([token_ids[start:end]], [table], [start], [0]))
            logits.append(self.logits_of_rows(hidden, list(range(end - start))))
        return torch.cat(logits)

    def prepare(self, inputs: StepInputs) -> ModelInput:
        """The step's tensors, on the model's device; block_tables[b] must cover request b's
        positions up to the end of its chunk.

        A chunk whose every row samples (a decode and its drafts, in verification) is laid out
        as one decode query per row, each attending to the context up to its own position: the
        same attention as one causal chunk, and a step of decodes and verifications stays a
        decode step, which runs on the fused CPU decoder stack and on CUDA graphs. Within a
        layer every row's KV is written before any row attends, so row j sees the drafts
        before it."""
        bs = self.block_size
        input_ids, positions, tables, seq_lens, query_start_loc, sample_rows = [], [], [], [], [0], []
        num_scheduled_tokens = [len(c) for c in inputs.chunks]
        for chunk, table, start, num_samples in zip(
            inputs.chunks, inputs.block_tables, inputs.num_computed_tokens, inputs.num_sample_rows, strict=True
        ):
            num_new = len(chunk)
            end = start + num_new
            assert num_new > 0, (start, num_new)
            assert end <= len(table) * bs, "the block table must cover the context"
            assert num_samples <= num_new
            input_ids += chunk
            positions += range(start, end)
            queries = [(start, num_new)] if num_samples < num_new else [(start + j, 1) for j in range(num_new)]
            for first, count in queries:
                tables.append(list(table[: _cdiv(first + count, bs)]))
                seq_lens.append(first + count)
                query_start_loc.append(query_start_loc[-1] + count)
            sample_rows += range(query_start_loc[-1] - num_samples, query_start_loc[-1])
        width = max(map(len, tables))
        block_tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        query_of_row = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(query_lens, dtype=torch.int64))
        slot_mapping = block_tables_t[query_of_row, positions_t // bs].long() * bs + positions_t % bs

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.config.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            block_tables=to_device(block_tables_t),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=to_device(torch.tensor(query_start_loc, dtype=torch.int32)),
            max_seq_len=max(seq_lens),
            max_query_len=max(query_lens),
        )
        return ModelInput(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.int64)),
            positions=to_device(positions_t),
            meta=meta,
            sample_rows=to_device(torch.tensor(sample_rows, dtype=torch.int64)),
            lora_slots=None if inputs.lora_slots is None else to_device(torch.repeat_interleave(
                torch.tensor(inputs.lora_slots, dtype=torch.int64), torch.tensor(num_scheduled_tokens, dtype=torch.int64))),
        )

    @torch.inference_mode()
    def _forward(self, batch: ModelInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final hidden states; on CUDA graphs padded past the batch's rows, which come first.
        A step with adapter rows runs eagerly: the graphs were captured without them."""
        if batch.lora_slots is None and self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            assert kv_caches is self.kv_caches, "the graphs were captured on the engine's KV cache"
            return self.decode_graphs.forward(batch)
        if self.lora_slots is None:
            return self.model(batch.input_ids, batch.positions, kv_caches, batch.meta)
        self.lora_slots.batch.slots = batch.lora_slots
        try:
            return self.model(batch.input_ids, batch.positions, kv_caches, batch.meta)
        finally:
            self.lora_slots.batch.slots = None
