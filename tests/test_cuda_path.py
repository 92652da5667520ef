"""The CUDA path, as far as a CPU can check it.

- The Triton backend end to end: a greedy generation through `trillm.LLM` on a tiny random Llama,
  with chunked prefill, a decode phase and prefix-cache hits, equals the torch backend's token for
  token. Without CUDA the kernels run in the Triton interpreter.
- CUDA-graph padding: a decode batch padded to a ladder size gives its real rows the logits of the
  unpadded batch, writes no KV for the padding rows, and leaves padding in every row past the real
  ones. Capture and replay themselves need a GPU: the last test runs only on one.
"""
import random

import pytest
import torch

import trillm
from trillm import SamplingParams
from trillm.config import EngineArgs
from trillm.model.cuda_graphs import DecodeInputs, capture_sizes, padded_size, use_cuda_graphs
from trillm.model.runner import ModelRunner, StepInputs

BLOCK_SIZE = 4
MAX_TOKENS = 16
STEP_BUDGET = 16  # tokens per step: the longer prompts take several chunks


def greedy_generations(model_dir: str, backend: str) -> tuple[list, dict]:
    """One prompt, then a batch of three: two share its first 16 tokens (4 full blocks, a prefix
    hit), one is longer than the step budget (chunked prefill)."""
    llm = trillm.LLM(
        model_dir,
        attention_backend=backend,
        dtype="float32",  # also on a GPU, where "auto" would be bf16
        block_size=BLOCK_SIZE,
        num_kv_blocks=40,
        max_num_batched_tokens=STEP_BUDGET,
        max_num_seqs=4,
        # drafts in every step, as both backends must step alike (the default's measured policy
        # follows the backends' speeds)
        speculative_config='{"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 0}',
    )
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    prefix = tokens(17)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([prefix + tokens(2)], greedy)
    batch = [prefix + tokens(5), tokens(26), prefix[:16] + tokens(3)]
    assert max(map(len, batch)) > STEP_BUDGET
    rest = llm.generate(batch, greedy)
    return first + rest, llm.engine.stats()


@pytest.mark.cuda(cpu_too=True)
def test_triton_backend_generates_what_the_torch_backend_does(tiny_model_dir):
    pytest.importorskip("triton")
    model_dir = tiny_model_dir("llama")
    reference, reference_stats = greedy_generations(model_dir, "torch")
    outputs, stats = greedy_generations(model_dir, "triton")
    assert stats.prefix_cache_hits > 0 and [o.num_cached_tokens for o in outputs[1:]] == [16, 0, 16]
    assert stats == reference_stats
    for got, expected in zip(outputs, reference):
        (completion,) = got.outputs
        assert completion.text == ""  # the tiny model has no tokenizer
        assert len(completion.token_ids) == MAX_TOKENS and completion.finish_reason == "length"
        assert completion.token_ids == expected.outputs[0].token_ids
        # Greedy tokens survive small errors; their logprobs show them.
        torch.testing.assert_close(
            [lp.logprob for lp in completion.logprobs],
            [lp.logprob for lp in expected.outputs[0].logprobs],
            atol=1e-4,
            rtol=1e-4,
        )
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > MAX_TOKENS  # not one repeated token


def test_capture_ladder_covers_every_decode_batch():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    for max_num_seqs in (1, 3, 8, 20, 256, 1000):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_num_seqs, 256)
        for n in range(1, sizes[-1] + 1):
            size = padded_size(sizes, n)
            assert size >= n and all(s < n for s in sizes if s < size)
        assert padded_size(sizes, sizes[-1] + 1) is None


def test_graphs_only_on_cuda_with_the_triton_kernels():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_cuda_graphs(cuda, False, "auto") and use_cuda_graphs(cuda, False, "triton")
    assert not use_cuda_graphs(cuda, True, "auto")  # enforce_eager
    assert not use_cuda_graphs(cuda, False, "torch")  # its kernels sync with the host
    assert not use_cuda_graphs(cpu, False, "triton")


def run_model(runner: ModelRunner, batch) -> torch.Tensor:
    """The eager forward of a ModelInput, logits for its sample rows."""
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
        return runner.model.compute_logits(hidden[batch.sample_rows]).float()


def decode_step(runner: ModelRunner, token_ids: list[list[int]], tables: list[list[int]]):
    n = len(token_ids)
    return runner.prepare(StepInputs([t[-1:] for t in token_ids], tables, [len(t) - 1 for t in token_ids], [1] * n))


def assert_only_slots_changed(runner: ModelRunner, before: list[torch.Tensor], slots: torch.Tensor):
    """The cache equals `before` except at `slots`, where it is close (rewritten with the same
    keys and values, up to rounding of a different batch shape)."""
    others = torch.ones(runner.num_kv_blocks * BLOCK_SIZE, dtype=torch.bool, device=runner.config.device)
    others[slots] = False
    after = [c.flatten(0, 1) for kv in runner.kv_caches for c in kv]
    for now, then in zip(after, before):
        assert torch.equal(now[others], then[others]), "a padding row wrote to the KV cache"
        torch.testing.assert_close(now[slots], then[slots], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda(cpu_too=True)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_batch_gives_the_unpadded_logits(tiny_model_dir, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    runner = ModelRunner(
        EngineArgs(
            model=tiny_model_dir("llama"), attention_backend=backend, dtype="float32", num_kv_blocks=24,
            block_size=BLOCK_SIZE, max_model_len=64,
        )
    )
    rng = random.Random(1)
    lengths = [9, 5, 14]
    blocks = list(range(1, runner.num_kv_blocks))
    rng.shuffle(blocks)
    blocks.insert(0, 0)  # block 0, which padding rows read, holds the first request's prompt
    tables = []
    for length in lengths:
        num_blocks = -(-(length + 2) // BLOCK_SIZE)  # the prompt and two decoded tokens
        tables.append(blocks[:num_blocks])
        blocks = blocks[num_blocks:]
    token_ids = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    prefill = run_model(runner, runner.prepare(StepInputs([list(t) for t in token_ids], tables, [0, 0, 0], [1] * 3)))
    for ids, token in zip(token_ids, prefill.argmax(-1).tolist()):
        ids.append(token)

    inputs = DecodeInputs(8, 64 // BLOCK_SIZE, 64, runner.config.device)
    # Three requests padded to 8 rows, then two of them (in the other order) padded to 4 rows of
    # the same buffers: rows that were real in the first step must become padding.
    for order, size in (([0, 1, 2], 8), ([2, 0], 4)):
        batch = decode_step(runner, [token_ids[b] for b in order], [tables[b] for b in order])
        unpadded = run_model(runner, batch)
        before = [c.flatten(0, 1).clone() for kv in runner.kv_caches for c in kv]
        padded = inputs.load(batch, size)
        n = len(order)
        assert padded.input_ids.shape == (size,) and padded.meta.block_tables.shape == (size, 64 // BLOCK_SIZE)
        assert (padded.meta.slot_mapping[n:] == -1).all() and (padded.meta.seq_lens[n:] == 1).all()
        assert (padded.meta.block_tables[n:] == 0).all() and padded.meta.query_start_loc.tolist() == list(
            range(size + 1)
        )
        got = run_model(runner, padded)
        assert got.shape == unpadded.shape == (n, runner.config.hf_config.vocab_size)
        torch.testing.assert_close(got, unpadded, atol=1e-5, rtol=1e-5)
        assert_only_slots_changed(runner, before, batch.meta.slot_mapping)
        for ids, token in zip([token_ids[b] for b in order], unpadded.argmax(-1).tolist()):
            ids.append(token)


@pytest.mark.cuda
def test_cuda_graphs_generate_what_eager_does(tiny_model_dir):
    """Requests of different lengths finish at different steps, so decode batches of 10 down to
    1 rows replay graphs of several padded sizes."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(10)]
    results = []
    for enforce_eager in (True, False):
        llm = trillm.LLM(
            tiny_model_dir("llama"), device="cuda", dtype="float32", enforce_eager=enforce_eager,
            num_kv_blocks=64, max_num_seqs=16,
        )
        assert (llm.engine.runner.decode_graphs is None) == enforce_eager
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]
