"""CUDA graphs for decode steps.

Why: a decode step of a small model is hundreds of tiny kernel launches (a few per layer), and
at small batches the CPU cost of launching them exceeds the GPU time they take. A CUDA graph
replays the whole forward as one launch.

A graph replays fixed kernels on fixed addresses with fixed shapes, so:
- only pure-decode steps are captured (every request computes exactly one token): their shape
  is the batch size alone. A step with a prefill chunk runs eagerly.
- batch sizes come from a ladder (1, 2, 4, 8, then every 8); a step is padded up to the next
  size, and a step larger than the largest runs eagerly.
- inputs live in static buffers (`DecodeInputs`), which the step's tensors are copied into
  before a replay. Padding rows are harmless by construction: slot -1 (the KV write skips it),
  token 0 at position 0 with seq_len 1 over a block table of zeros (attention reads the first
  slot of block 0, in bounds; the row's output is discarded).
- nothing inside the forward may read a device value on the host: the Triton kernels size
  their launch grids from shapes only (see trillm/kernels/attention_triton.py) and skip
  negative slots on the device. The torch reference kernels do sync (`.tolist()`), so graphs
  are used with the Triton backend only.

The padding (`DecodeInputs.load`) is plain tensor code, tested on CPU with both backends
(tests/test_cuda_path.py): the real rows' logits of a padded batch equal the unpadded ones.
Capture and replay (`DecodeGraphs`) need a GPU and have not yet been run on one.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from trillm.config import AttentionBackend
from trillm.kernels.attention_metadata import AttentionMetadata

MAX_CAPTURE_SIZE = 256  # above this, launch overhead is small next to the step itself


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8, up to min(max_num_seqs, MAX_CAPTURE_SIZE), which is always
    included, so every decode batch the scheduler can form up to that size has a graph."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    assert top >= 1
    ladder = [s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top]
    return ladder if ladder[-1] == top else [*ladder, top]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest size in the ascending ladder that holds num_seqs rows; None above the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_pure_decode(meta: AttentionMetadata) -> bool:
    """Every request computes one token. max_query_len is a host int: deciding costs no sync."""
    return meta.max_query_len == 1


class DecodeInputs:
    """Static input buffers for decode steps of up to `max_num_seqs` rows, with block tables as
    wide as the longest sequence (max_model_len) can need. Every graph reads their first rows,
    so one set of buffers serves all sizes, and their addresses never change.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device):
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=device)
        # One query per row, always: row b's query starts at b.
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)

    @property
    def max_num_seqs(self) -> int:
        return self.input_ids.shape[0]

    def meta(self, size: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """The attention metadata of the first `size` rows. max_seq_len is informative only (no
        kernel reads it; a graph could not follow it anyway): by default the bound max_model_len."""
        assert 1 <= size <= self.max_num_seqs
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_seq_len=max_seq_len or self.max_model_len,
            max_query_len=1,
        )

    def load(self, batch, size: int):
        """Copies a pure-decode batch (the runner's ModelInput, n <= size rows) into rows [0, n),
        makes rows [n, size) padding, and returns the batch over the first `size` rows of the
        buffers. Its sample_rows stay the batch's own (0..n-1), so `hidden[sample_rows]` drops
        the padding. Rows past `size` are left as they are: no graph of this size reads them."""
        n = batch.input_ids.shape[0]
        assert is_pure_decode(batch.meta) and n <= size, (batch.meta.max_query_len, n, size)
        width = batch.meta.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.meta.slot_mapping)
        self.seq_lens[:n].copy_(batch.meta.seq_lens)
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(batch.meta.block_tables)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        return dataclasses.replace(
            batch,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            meta=self.meta(size, batch.meta.max_seq_len),
        )


def use_cuda_graphs(device: torch.device, enforce_eager: bool, attention_backend: AttentionBackend) -> bool:
    """CUDA only, not when eager is forced, and not with the torch kernels, which read device
    values on the host (a sync, which capture forbids). "auto" is Triton on CUDA."""
    return device.type == "cuda" and not enforce_eager and attention_backend != AttentionBackend.TORCH


class DecodeGraphs:
    """One captured forward per ladder size, over one KV cache and one set of static inputs.

    All graphs share one memory pool, captured largest first so that each smaller graph fits
    in memory the larger ones already hold; graphs never run concurrently, so sharing is safe.
    Split-KV is chosen from shapes, here the block-table width (max_model_len), not the real
    context: short contexts may get idle split programs. The pool is not in the KV budget:
    its size (activations of at most MAX_CAPTURE_SIZE tokens) is far below the profiled peak of
    a max_num_batched_tokens step, and gpu_memory_utilization leaves headroom for it.

    Not yet run on a GPU; the padding it relies on is tested on CPU.
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        device = model.model.embed_tokens.weight.device
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks, max_model_len, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output, rewritten by each replay
        self._capture_all()

    def can_run(self, batch) -> bool:
        return is_pure_decode(batch.meta) and batch.input_ids.shape[0] <= self.sizes[-1]

    def forward(self, batch) -> torch.Tensor:
        """Replays the graph of the batch's padded size. Returns the hidden states of all its
        rows, [size, hidden_size]: the batch's sample_rows (0..n-1) pick the real ones. The
        tensor is the graph's own output, overwritten by the next replay."""
        size = padded_size(self.sizes, batch.input_ids.shape[0])
        assert size is not None and is_pure_decode(batch.meta)
        self.inputs.load(batch, size)
        self.graphs[size].replay()
        return self.hidden[size]

    def _run_model(self, size: int) -> torch.Tensor:
        inputs = self.inputs
        return self.model(inputs.input_ids[:size], inputs.positions[:size], self.kv_caches, inputs.meta(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """The buffers hold padding only here (slot -1 everywhere), so capture writes no KV."""
        pool = None
        for size in reversed(self.sizes):
            self._run_model(size)  # warm-up: Triton compiles its kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[size] = self._run_model(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
