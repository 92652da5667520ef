"""The model on the paged KV cache, judged against transformers' forward on the same weights.

Batches are written by hand (the runner reads five SchedulerOutput fields) so that each test picks
its own chunk boundaries and block tables: chunks that end mid-block, blocks out of order.
"""
import os
import random
from dataclasses import dataclass, replace

import pytest
import torch
from process_support import fresh_process_output, resident_bytes
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import trillm.config
from trillm.config import EngineArgs
from trillm.heap import TrimAfterPrompts
from trillm.model.loader import check_model
from trillm.model.runner import ModelRunner

BLOCK_SIZE = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@dataclass
class Request:
    """What the runner reads of a scheduler Request: the tokens so far and the blocks holding them."""

    token_ids: list[int]
    block_table: list[int]


@dataclass
class Scheduled:
    """What the runner reads of a scheduler's ScheduledRequest."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int

    draft_token_ids = ()

    @property
    def needs_sample(self) -> bool:
        return self.num_computed_tokens + self.num_new_tokens == len(self.request.token_ids)

    @property
    def num_sample_rows(self) -> int:
        return int(self.needs_sample)


@dataclass
class Schedule:
    scheduled: list[Scheduled]

    @property
    def total_num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.scheduled)


class Sequence:
    """One request's prompt and the tokens it will go on to decode. `chunk` shows the request as the
    scheduler would when computing tokens [start, start + n): it holds the whole prompt and the
    decoded tokens up to there, so a chunk samples only once it reaches the end of those."""

    def __init__(self, token_ids: list[int], block_table: list[int], num_decode: int):
        self.token_ids, self.block_table, self.num_decode = token_ids, block_table, num_decode

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids) - self.num_decode

    def chunk(self, start: int, n: int) -> tuple[Request, int, int]:
        return Request(self.token_ids[: max(self.prompt_len, start + n)], self.block_table), start, n


def run_step(runner: ModelRunner, chunks: list[tuple[Request, int, int]]) -> torch.Tensor:
    """The step's logits, copied: the runner's own live only until its next step."""
    out = runner.execute(Schedule([Scheduled(r, n, s) for r, s, n in chunks]))
    return runner.step_logits(out.sample_hidden).clone()


def make_sequences(runner: ModelRunner, lengths: list[int], num_decode: int = 0, seed: int = 0) -> list[Sequence]:
    """Random tokens (the last num_decode of each to be decoded) and disjoint, shuffled block tables."""
    rng = random.Random(seed)
    blocks = list(range(runner.num_kv_blocks))
    rng.shuffle(blocks)
    sequences = []
    for length in lengths:
        num_blocks = -(-length // runner.block_size)
        table, blocks = blocks[:num_blocks], blocks[num_blocks:]
        assert len(table) == num_blocks, "test pool too small"
        tokens = [rng.randrange(3, runner.config.hf_config.vocab_size) for _ in range(length)]
        sequences.append(Sequence(tokens, table, num_decode))
    return sequences


# the exact path, which transformers' logits judge: fp32 activations and an fp32 KV cache
# fp32 on CUDA too, where "auto" would be bf16
EXACT = dict(quantized_activations=False, kv_cache_dtype="float32", dtype="float32")


def tiny_runner(model_dir: str, **args) -> ModelRunner:
    return ModelRunner(EngineArgs(model=model_dir, num_kv_blocks=48, block_size=BLOCK_SIZE, **{**EXACT, **args}))


def hf_logits(model_dir: str, sequences: list[Sequence]) -> list[torch.Tensor]:
    """transformers' logits at every position of each sequence, one sequence at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([s.token_ids])).logits[0] for s in sequences]


def prefill_then_decode(runner: ModelRunner, sequences: list[Sequence]) -> list[torch.Tensor]:
    """Every prompt in one batched step, then one batched step per decoded token. Returns per
    sequence its logits at the sampled positions: prompt_len - 1 and on."""
    num_decode = sequences[0].num_decode
    assert all(s.num_decode == num_decode for s in sequences)
    steps = [run_step(runner, [s.chunk(0, s.prompt_len) for s in sequences])]
    for i in range(num_decode):
        steps.append(run_step(runner, [s.chunk(s.prompt_len + i, 1) for s in sequences]))
    return [torch.stack([step[b] for step in steps]).cpu() for b in range(len(sequences))]


VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": ("qwen2", {"rope_parameters": YARN_ROPE}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {}),
    "gemma3": ("gemma3_text", {}),
    "phi3-window": ("phi3", {}),
}


@pytest.mark.cuda(cpu_too=True)  # on the Triton kernels on a GPU, the CPU kernels here
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_models_match_transformers(tiny_model_dir, variant):
    kind, overrides = VARIANTS[variant]
    model_dir = tiny_model_dir(kind, **overrides)
    runner = tiny_runner(model_dir)
    sequences = make_sequences(runner, [21, 13, 6], num_decode=3)
    ours = prefill_then_decode(runner, sequences)
    for seq, got, ref in zip(sequences, ours, hf_logits(model_dir, sequences)):
        expected = ref[seq.prompt_len - 1 :]
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# Each variant against the same weights without its feature: if the feature were a no-op, the
# comparisons above would not be testing it.
@pytest.mark.parametrize(
    "kind, feature, without",
    [
        ("mistral", {}, {"sliding_window": None}),
        ("llama", {"rope_parameters": LLAMA3_ROPE}, {"rope_parameters": {**LLAMA3_ROPE, "rope_type": "default"}}),
        ("qwen2", {"rope_parameters": YARN_ROPE}, {}),
        ("gemma3_text", {}, {"sliding_window": 64}),
        ("gemma3_text", {}, {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
    ],
)
def test_variant_features_change_the_logits(tiny_model_dir, kind, feature, without):
    logits = []
    for overrides in (feature, without):
        runner = tiny_runner(tiny_model_dir(kind, **overrides))
        (seq,) = make_sequences(runner, [21])
        logits.append(run_step(runner, [seq.chunk(0, 21)]))
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_chunked_prefill_equals_one_chunk(tiny_model_dir):
    runner = tiny_runner(tiny_model_dir("qwen3"))
    one, chunked = make_sequences(runner, [26, 26], num_decode=3)
    chunked.token_ids = one.token_ids  # same tokens, other blocks
    prompt_len = one.prompt_len

    whole = [run_step(runner, [one.chunk(0, prompt_len)])]
    pieces = []
    for start, end in [(0, 5), (5, 11), (11, prompt_len)]:  # boundaries in the middle of blocks
        pieces.append(run_step(runner, [chunked.chunk(start, end - start)]))
    assert [p.shape[0] for p in pieces] == [0, 0, 1]  # only the chunk reaching the end samples
    for pos in range(prompt_len, 26):
        whole.append(run_step(runner, [one.chunk(pos, 1)]))
        pieces.append(run_step(runner, [chunked.chunk(pos, 1)]))
    torch.testing.assert_close(torch.cat(pieces), torch.cat(whole), atol=1e-5, rtol=1e-5)


def test_mixed_batch_equals_each_request_alone(tiny_model_dir):
    runner = tiny_runner(tiny_model_dir("mistral"))
    decoding, partial, finishing = make_sequences(runner, [14, 30, 17], num_decode=1)
    # Alone: the decoding request's prompt, then its decode step; the others' chunks one by one.
    run_step(runner, [decoding.chunk(0, 13)])
    alone_decode = run_step(runner, [decoding.chunk(13, 1)])
    run_step(runner, [partial.chunk(0, 9)])
    assert run_step(runner, [partial.chunk(9, 10)]).shape[0] == 0
    alone_finish = run_step(runner, [finishing.chunk(0, finishing.prompt_len)])
    alone_partial_end = run_step(runner, [partial.chunk(19, partial.prompt_len - 19)])

    # Together, on fresh blocks: one step holding a decode, a mid-prompt chunk and a whole prompt.
    again = make_sequences(runner, [14, 30, 17], num_decode=1, seed=1)
    for new, old in zip(again, (decoding, partial, finishing)):
        new.token_ids = old.token_ids
    decoding, partial, finishing = again
    run_step(runner, [decoding.chunk(0, 13), partial.chunk(0, 9)])
    mixed = run_step(
        runner, [decoding.chunk(13, 1), partial.chunk(9, 10), finishing.chunk(0, finishing.prompt_len)]
    )
    assert mixed.shape[0] == 2
    torch.testing.assert_close(mixed[0], alone_decode[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], alone_finish[0], atol=1e-5, rtol=1e-5)
    partial_end = run_step(runner, [partial.chunk(19, partial.prompt_len - 19)])
    torch.testing.assert_close(partial_end, alone_partial_end, atol=1e-5, rtol=1e-5)


def test_dummy_weights_are_finite_and_seeded(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    logits = []
    for seed in (0, 0, 1):
        runner = tiny_runner(model_dir, load_format="dummy", seed=seed)
        logits.append(prefill_then_decode(runner, make_sequences(runner, [12, 5], num_decode=2)))
    assert all(torch.isfinite(x).all() for x in logits[0])
    assert all(torch.equal(a, b) for a, b in zip(logits[0], logits[1]))
    assert not torch.allclose(logits[0][0], logits[2][0])


def test_dummy_weights_of_the_default_model_in_bf16(default_model_dir):
    runner = ModelRunner(
        EngineArgs(model=default_model_dir, load_format="dummy", dtype="bfloat16", num_kv_blocks=8)
    )
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    (seq,) = make_sequences(runner, [40])
    logits = run_step(runner, [seq.chunk(0, 40)])
    assert logits.dtype == torch.float32 and logits.shape == (1, runner.config.hf_config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("kv_cache_dtype,dtype,row_bytes", [
    ("auto", torch.float16, 64), ("float32", torch.float32, 128), ("int8", torch.int8, 34)])
def test_kv_cache_sized_from_the_memory_budget(tiny_model_dir, kv_cache_dtype, dtype, row_bytes):
    """On CPU an fp32 model's cache is fp16 unless asked otherwise: twice the blocks. An int8
    cache holds a row of head_dim values in head_dim + 2 bytes (its fp16 scale last)."""
    runner = ModelRunner(EngineArgs(model=tiny_model_dir("qwen3"), block_size=8, kv_cache_memory=1 << 20,
                                    kv_cache_dtype=kv_cache_dtype))
    cfg = runner.config.hf_config
    # 2 (K and V) * 2 layers * 8 tokens * 2 kv heads * bytes per row of head_dim 32
    assert runner.block_bytes == 2 * 2 * 8 * 2 * row_bytes
    assert runner.num_kv_blocks == (1 << 20) // runner.block_bytes
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (runner.num_kv_blocks, 8, 2, row_bytes // dtype.itemsize) and k.is_contiguous()
        assert k.dtype == v.dtype == dtype
    assert runner.config.max_model_len == cfg.max_position_embeddings == 256
    assert runner.config.eos_token_id == 2
    # `trillm serve` refuses from the header alone the budgets the runner would find hold no block
    one_block = replace(runner.args, kv_cache_memory=runner.block_bytes)
    check_model(one_block)
    assert ModelRunner(one_block).num_kv_blocks == 1
    short = replace(one_block, kv_cache_memory=runner.block_bytes - 1)
    for args in (short, replace(short, tensor_parallel_size=2)):  # each of 2 ranks: 1 of the 2 KV heads
        with pytest.raises(ValueError, match=f"holds no block of the KV cache: one of 8 tokens takes "
                                             f"{runner.block_bytes} bytes"):
            check_model(args)
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(short)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(EngineArgs(model=tiny_model_dir("qwen3"), num_kv_blocks=4, max_model_len=257))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_backend_matches_torch(tiny_model_dir, backend, kv_cache_dtype):
    """Each family's kernels give the twins' logits, on an fp32 cache or an int8 one."""
    if backend == "triton":
        pytest.importorskip("triton")
    model_dir = tiny_model_dir("qwen3", sliding_window=6, use_sliding_window=True, max_window_layers=1)
    outputs = []
    for name in ("torch", backend):
        runner = tiny_runner(model_dir, attention_backend=name, kv_cache_dtype=kv_cache_dtype)
        assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
        outputs.append(prefill_then_decode(runner, make_sequences(runner, [11, 7], num_decode=2)))
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_gemma3_on_each_family_matches_torch(tiny_model_dir, backend):
    """Gemma 3's own ops (GeGLU, sandwich norms, a RoPE cache per layer type) on each family."""
    model_dir = tiny_model_dir("gemma3_text")
    outputs = [prefill_then_decode(runner, make_sequences(runner, [11, 7], num_decode=2))
               for runner in (tiny_runner(model_dir, attention_backend=name) for name in ("torch", backend))]
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village nestled between two mountains, there lived an old clockmaker who",
]


@pytest.mark.cuda(cpu_too=True)
@pytest.mark.parametrize("source", ["hf-dir", "gguf"])
def test_default_model_matches_transformers(default_model_dir, source):
    """From the converted directory (fp32 projections) and from the GGUF file itself (on CPU, the
    projections multiply by its quantized blocks, on the exact path: fp32 activations): the same
    greedy tokens as transformers."""
    model = default_model_dir if source == "hf-dir" else None
    runner = ModelRunner(EngineArgs(model=model, num_kv_blocks=32, block_size=16, **EXACT))
    assert runner.model.kernels.name == ("triton" if runner.config.device.type == "cuda" else "cpu")  # auto's choice
    on_blocks = runner.model.lm_head.quantized is not None
    assert on_blocks == (source == "gguf" and runner.config.device.type == "cpu")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    num_decode = 4
    with torch.inference_mode():  # transformers' greedy continuation, and its logits along the way
        full = [
            hf.generate(torch.tensor([ids]), max_new_tokens=num_decode, do_sample=False)[0].tolist()
            for ids in prompts
        ]
    sequences = make_sequences(runner, [len(ids) for ids in full], num_decode=num_decode)
    for seq, ids in zip(sequences, full):
        seq.token_ids = ids
    ours = prefill_then_decode(runner, sequences)
    for seq, got, ref in zip(sequences, ours, hf_logits(default_model_dir, sequences)):
        expected = ref[seq.prompt_len - 1 :]
        assert (got - expected).abs().max() < 1e-3
        # greedy: our argmax at each step is the token transformers generated next
        assert got[:-1].argmax(-1).tolist() == seq.token_ids[seq.prompt_len :]


@pytest.mark.parametrize("model, lengths, bits", [
    ("default", [57], {4, 8}), ("default", [40, 7, 23], {4, 8}), ("tiny-Q5_K_M", [40, 7], {5, 6}),
    ("qwen3-Q8_0", [40, 7], {8}), ("gemma3_text-Q8_0", [40, 7], {8}),
    ("default", [40, 7, 23, 6, 12, 30, 9, 17, 8, 26], {4, 8}),
], ids=["one", "three", "five_bit_blocks", "qk_norms", "gemma_sandwich", "ten"])
def test_the_fused_decoder_stack_gives_the_layers_logits_to_the_bit(model, lengths, bits, tiny_model_dir, tmp_path):
    """A decode step of the default model runs every layer in one compiled call (DecoderStack);
    its logits are the layer-by-layer path's, bit for bit, alone and beside other requests of
    other lengths, and steps with prompt rows keep the layers. So does a file whose projections
    are Q5_K (the 5-bit layout) and Q6_K (its own 6-bit layout, a part of its own where a fused
    projection mixes it with Q5_K), a Qwen3 file, whose layers norm each head's queries and
    keys, and a Gemma 3 file (sandwich norms, GeGLU, a sliding layer at its own RoPE base, contexts
    past its window); and ten rows, past the 8 that AVX-512 takes (so on AMX tiles where the CPU
    has them)."""
    from gguf import GGMLQuantizationType
    from gguf_support import write_gguf

    model_path = {"default": None, "tiny-Q5_K_M": os.path.join(os.path.dirname(__file__), "data", "gguf",
                                                               "tiny-Q5_K_M.gguf")}.get(model)
    if model.endswith("-Q8_0"):
        kind = model.removesuffix("-Q8_0")
        model_path = write_gguf(tiny_model_dir(kind, hidden_size=128, intermediate_size=256),
                                str(tmp_path / f"{kind}.gguf"), GGMLQuantizationType.Q8_0)
    runner = ModelRunner(EngineArgs(model=model_path, num_kv_blocks=64))
    model = runner.model.model
    stack = model.decoder_stack
    assert stack is not None, "the model's decode steps should run fused"
    assert {b for m in runner.model.modules() if getattr(m, "quantized", None) is not None
            for b in m.quantized.bits} == bits
    sequences = make_sequences(runner, lengths, num_decode=4)
    calls = []
    model.decoder_stack = CountingStack(stack, calls)
    fused = prefill_then_decode(runner, sequences)
    assert len(calls) == 4  # the decode steps, not the prefill
    model.decoder_stack = None
    layered = prefill_then_decode(runner, sequences)
    for f, l in zip(fused, layered):
        assert torch.equal(f, l), (f - l).abs().max()


def test_decode_steps_between_steps_of_other_sizes_give_the_same_logits():
    """Ten requests' decode steps (the fused stack, on AMX tiles where the CPU has them) give the
    same logits when between them a step of twenty other prompts runs on the layers and samples
    twenty rows: the stack and the layers are compiled apart, and on AMX each sets the tiles'
    shape for its rows; neither may trust a shape it set before, since the other may have
    replaced it (the stack trusted its own note of it, and its rows past the other's shape were
    garbage)."""
    runner = ModelRunner(EngineArgs(num_kv_blocks=64))
    assert runner.model.model.decoder_stack is not None
    sequences = make_sequences(runner, [40, 7, 23, 6, 12, 30, 9, 17, 8, 26] + [6] * 20, num_decode=2)
    ten, others = sequences[:10], sequences[10:]
    alone = prefill_then_decode(runner, ten)
    steps = [run_step(runner, [s.chunk(0, s.prompt_len) for s in ten])]
    for i in range(2):
        run_step(runner, [s.chunk(0, s.prompt_len) for s in others])
        steps.append(run_step(runner, [s.chunk(s.prompt_len + i, 1) for s in ten]))
    for b, want in enumerate(alone):
        got = torch.stack([step[b] for step in steps])
        assert torch.equal(got, want), (b, (got - want).abs().max())


class CountingStack:
    def __init__(self, stack, calls: list):
        self.stack, self.calls = stack, calls

    def run(self, *args):
        self.calls.append(args[0].shape[0])
        return self.stack.run(*args)


def test_integer_activations_agree_with_the_exact_path_on_the_default_model():
    """The default path (8-bit activations against the GGUF blocks, an fp16 KV cache) predicts, teacher-forced on
    the opening of benchmarks/data/eval_text.txt, the exact path's next token almost everywhere,
    at almost the same perplexity; so does the exact path on an int8 KV cache (the whole text's
    figures: benchmarks/bench_agreement.py)."""
    text_path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "eval_text.txt")
    with open(text_path) as f:
        text = f.read()[:1500]
    logits = {}
    for path, args in (("exact", EXACT), ("default", {}), ("int8 cache", {**EXACT, "kv_cache_dtype": "int8"})):
        runner = ModelRunner(EngineArgs(num_kv_blocks=32, **args))
        assert runner.model.lm_head.quantized is not None
        token_ids = runner.tokenizer.encode(text)
        logits[path] = runner.teacher_forced_logits(token_ids, chunk=128)
    targets = torch.tensor(token_ids[1:])
    perplexity = {k: torch.nn.functional.cross_entropy(v[:-1], targets).exp().item() for k, v in logits.items()}
    assert len(token_ids) > 250
    for path, least in (("default", 0.9), ("int8 cache", 0.95)):
        agreement = (logits["exact"].argmax(-1) == logits[path].argmax(-1)).float().mean().item()
        assert agreement > least, (path, agreement)
        assert abs(perplexity[path] / perplexity["exact"] - 1) < 0.02, perplexity
        assert not torch.equal(logits["exact"], logits[path])  # two paths, not one twice


def test_the_default_cpu_budget_is_half_the_memory_available(tiny_model_dir, monkeypatch):
    """Unset, the CPU budget is half the memory available once the weights are in (a fixed GiB
    made a 1.7B model preempt requests at c=32 on a 24 GB machine), but no more blocks than
    max_num_seqs sequences of the full context fill."""
    monkeypatch.setattr(trillm.config, "available_memory", lambda: 64 << 20)
    roomy = ModelRunner(EngineArgs(model=tiny_model_dir("qwen3"), block_size=8, max_num_seqs=1 << 20))
    assert roomy.num_kv_blocks == (32 << 20) // roomy.block_bytes
    few = ModelRunner(EngineArgs(model=tiny_model_dir("qwen3"), block_size=8, max_num_seqs=3))
    assert few.num_kv_blocks == -(-3 * few.config.max_model_len // 8) < (32 << 20) // few.block_bytes


def test_the_memory_available_stays_within_the_cgroup_limit(tmp_path):
    """In a container the machine's MemAvailable overstates what the process may take: its
    cgroup's limit, less what the cgroup uses, bounds it."""
    from trillm.config import available_memory

    # A fixed machine figure: the real MemAvailable moves while other tests load models.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       8388608 kB\nMemAvailable:   {2 << 20} kB\n")
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{256 << 20}\n")
    assert available_memory(str(tmp_path), str(meminfo)) == 768 << 20
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's
    assert available_memory(str(tmp_path), str(meminfo)) == 2 << 30
    assert available_memory(str(tmp_path / "absent"), str(meminfo)) == 2 << 30
    assert available_memory() > 0


def test_a_runner_pinned_to_fewer_cores_loads_on_no_more_torch_threads(monkeypatch):
    """torch sizes its thread pool as it is imported; a rank or a data-parallel replica is pinned
    to its share of the cores later. Loaded on more threads than the cores it may run on, the
    load's torch ops spun at every barrier (a replica took seconds where it takes a fraction of
    one). The load runs on as many as it has cores; serving on `num_threads`."""
    import trillm.model.runner

    cores = os.sched_getaffinity(0)
    during_load = []

    def load_model(*args, **kwargs):
        during_load.append(torch.get_num_threads())
        return real_load(*args, **kwargs)

    real_load = trillm.model.runner.load_model
    monkeypatch.setattr(trillm.model.runner, "load_model", load_model)
    torch.set_num_threads(2)  # as torch sized itself on a machine of two cores or more
    os.sched_setaffinity(0, {min(cores)})
    try:
        runner = ModelRunner(EngineArgs(num_kv_blocks=16, kernel_threads=len(cores)))
    finally:
        os.sched_setaffinity(0, cores)
    assert during_load == [1]
    assert torch.get_num_threads() == runner.args.num_threads


def test_kv_cache_memory_becomes_resident_only_as_blocks_are_written(tiny_model_dir):
    """A 4 GiB budget on CPU costs next to nothing until requests write blocks: the cache is an
    anonymous mapping (zero pages), not a zeroed, and so resident, allocation."""

    def resident_mib() -> float:
        return resident_bytes() / 2**20

    before = resident_mib()
    runner = ModelRunner(EngineArgs(model=tiny_model_dir("qwen3"), kv_cache_memory=4 << 30, max_num_seqs=1 << 20,
                                    **EXACT))
    assert runner.num_kv_blocks * runner.block_bytes > (4 << 30) - runner.block_bytes
    assert resident_mib() - before < 512
    k_cache, v_cache = runner.kv_caches[0]
    assert not k_cache.any() and not v_cache.any()  # zero, as attention needs
    seq = make_sequences(runner, [40])[0]
    assert torch.isfinite(run_step(runner, [seq.chunk(0, 40)])).all()


def test_cpu_steps_write_their_logits_into_one_buffer():
    """A step's logits (a 262k vocabulary's rows are 1 MiB each) go into a buffer the steps
    share, grown when a step samples more rows than any before: not a fresh allocation each
    step, which glibc maps and faults in anew or leaves in its heap."""
    runner = ModelRunner(EngineArgs(num_kv_blocks=64, block_size=16))
    assert runner.model.lm_head.quantized is not None
    one, two, three = make_sequences(runner, [20, 12, 9], seed=5)

    def logits(chunks):
        return runner.step_logits(runner.execute(Schedule([Scheduled(r, n, s) for r, s, n in chunks])).sample_hidden)

    first = logits([one.chunk(0, 20)])
    address, values = first.data_ptr(), first.clone()
    both = logits([two.chunk(0, 12), three.chunk(0, 9)])
    assert both.shape[0] == 2 and both.data_ptr() != address  # grown for two rows
    assert torch.equal(run_step(runner, [one.chunk(19, 1)]), values)  # the same row computed again
    assert logits([two.chunk(11, 1)]).data_ptr() == both.data_ptr()  # one row: the same buffer
    three_rows = logits([one.chunk(19, 1), two.chunk(11, 1), three.chunk(8, 1)])
    assert three_rows.data_ptr() != both.data_ptr()
    four = make_sequences(runner, [5], seed=6)[0]
    four_rows = logits([one.chunk(19, 1), two.chunk(11, 1), three.chunk(8, 1), four.chunk(0, 5)])
    assert four_rows.data_ptr() == three_rows.data_ptr(), "it doubled: two rows were the most, three made four"


HEAP_PROBE = """
import torch
from test_model import make_sequences, run_step, Schedule, Scheduled
from process_support import resident_bytes
from trillm.config import EngineArgs
from trillm.model.runner import ModelRunner
runner = ModelRunner(EngineArgs(num_kv_blocks=256, block_size=16))
run_step(runner, [make_sequences(runner, [16], seed=4)[0].chunk(0, 16)])
# a step of prompts, then one of decodes
one, two = make_sequences(runner, [1000, 1000], seed=5)
before = resident_bytes()
run_step(runner, [one.chunk(0, 1000), two.chunk(0, 1000)])
prompted = resident_bytes()
run_step(runner, [one.chunk(999, 1), two.chunk(999, 1)])
print(prompted - before, prompted - resident_bytes())
# steps sampling ever more rows: one past each size the logits buffer doubles at, and all 96
sequences = make_sequences(runner, [20] * 96, seed=5)
for sequence in sequences:
    run_step(runner, [sequence.chunk(0, 19)])
steps = [Schedule([Scheduled(r, k, s) for r, s, k in (q.chunk(19, 1) for q in sequences[:n])])
         for n in (1, 2, 3, 5, 9, 17, 33, 65, 96)]
for step in steps:  # the forward's own temporaries at each row count, first made here: not measured
    runner.execute(step)
raised = torch.empty(31 << 20, dtype=torch.uint8)
del raised  # glibc takes allocations below 31 MiB from its heap from now on
before = resident_bytes()
for step in steps:
    runner.step_logits(runner.execute(step).sample_hidden)
print(resident_bytes() - before, len(sequences) * runner.config.hf_config.vocab_size * 4)
"""


@pytest.fixture(scope="module")
def heap_probe() -> list[int]:
    """HEAP_PROBE's figures, in a process of its own."""
    return [int(n) for n in fresh_process_output(HEAP_PROBE).split()]


def test_decoding_after_prompts_hands_their_temporaries_back(heap_probe):
    """A step of 2,000 prompt tokens frees its layers' temporaries into glibc's heap; the
    first step after it without prompt tokens trims the heap (TrimAfterPrompts), so decoding
    does not keep them resident: the process shrinks by tens of MiB there, where it kept every
    byte before."""
    grown, released = heap_probe[:2]
    assert released > (24 << 20) and released < grown, (grown, released)


def test_the_heap_is_trimmed_once_prompts_give_way_to_decodes():
    trim = TrimAfterPrompts(256)
    assert [trim.step(n) for n in (100, 0, 100, 60, 0, 0, 300, 5, 0)] == \
        [False, False, False, False, True, False, False, False, True]


def test_outgrown_logits_buffers_leave_no_memory_behind(heap_probe):
    """As a step's sampled rows rise (drafts add them a few at a time), each outgrown logits
    buffer goes back to the system: the process grows by the last buffer alone. Taken from
    glibc's heap, as they were, each stayed behind as a hole once a prefill's freed temporaries
    had raised the size above which glibc maps an allocation: the process grew by 27 to 55 MiB
    where the last buffer is 18. The forward's own temporaries are made once before the measure:
    their first use at each row count grows the process by a few MiB of its own."""
    grown, last_buffer = heap_probe[2:]
    assert grown < last_buffer + (4 << 20), (grown, last_buffer)


def test_a_prompt_computes_the_same_whatever_else_the_step_holds():
    """On the default CPU path (8-bit activations, an fp16 cache) a prompt's last logits are the
    same to the bit whether it is prefilled whole and alone, in chunks beside another request's
    prefill and decodes, or after a prefix-cache hit (its first blocks written by another
    request): every kernel computes a row on its own. Before attention went row by row, SDPA's
    blocking followed the step's shape and a greedy answer could change with the cache's state."""
    runner = ModelRunner(EngineArgs(num_kv_blocks=64, block_size=16))
    assert runner.model.kernels.name == "cpu" and runner.model.kernels.kv_cache_dtype == torch.float16
    prompt, other = make_sequences(runner, [45, 30], seed=3)
    alone = run_step(runner, [prompt.chunk(0, 45)])[0]

    chunks = [(0, 7), (7, 16), (23, 22)]
    other_steps = [other.chunk(0, 30), other.chunk(29, 1), other.chunk(29, 1)]
    for (start, n), beside in zip(chunks, other_steps):
        logits = run_step(runner, [beside, prompt.chunk(start, n)])
    assert torch.equal(logits[-1], alone)

    # a prefix-cache hit: the first 32 positions' blocks already hold the prompt's keys and values
    assert torch.equal(run_step(runner, [prompt.chunk(32, 13)])[0], alone)


def test_greedy_under_the_real_scheduler_matches_transformers(tiny_model_dir):
    """The scheduler's own batches: chunked prefill (a 7-token budget), prefix-cache hits (a shared
    prefix: a request's first chunk starts past blocks another request wrote) and preemption (a
    pool too small for all four)."""
    from trillm.sched_ext import Request as SchedRequest
    from trillm.sched_ext import Scheduler

    model_dir = tiny_model_dir("llama")
    runner = ModelRunner(EngineArgs(model=model_dir, num_kv_blocks=14, block_size=BLOCK_SIZE, **EXACT))
    scheduler = Scheduler(runner.num_kv_blocks, BLOCK_SIZE, max_num_batched_tokens=7, max_num_seqs=4)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 256) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(n)] for n in (3, 6, 1, 5)]
    max_tokens = 8
    requests = [SchedRequest(str(i), p, max_tokens) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    num_partial_chunks = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        logits = runner.step_logits(runner.execute(out).sample_hidden)
        num_partial_chunks += sum(not e.needs_sample for e in out.scheduled)
        greedy = iter(logits.argmax(-1).tolist())
        scheduler.update(out, [next(greedy) if e.needs_sample else -1 for e in out.scheduled])
    assert num_partial_chunks > 0 and scheduler.allocator.prefix_cache_hits > 0
    assert sum(r.num_preemptions for r in requests) > 0

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for request, prompt in zip(requests, prompts):
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert request.token_ids[len(prompt) :] == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_projections_equal_their_dequantized_weights(tiny_model_dir, tied):
    """GGUF-style weights for every projection: each fused projection stacks its shards in
    order (q|k|v, gate|up), tied embeddings feed the vocab projection, a projection whose
    shards come in two formats moves onto one layout that holds both exactly, and one with a
    shard missing stays dense."""
    from test_kernels import random_gguf_blocks

    from trillm.model.llama import Linear
    from trillm.model.loader import load_model, load_quantized_weights, load_weights, on_quantized_blocks, param_shard
    from trillm.kernels import quant

    model_dir = tiny_model_dir("llama", tie_word_embeddings=tied)
    quantized = load_model(EngineArgs(model=model_dir, quantized_activations=False)).model  # the exact path
    dense = load_model(EngineArgs(model=model_dir, attention_backend="torch")).model
    shapes = {name: tuple(t.shape) for name, t in dense.state_dict().items()}
    hf_names = [f"model.layers.{i}.{proj}.weight" for i in range(2) for proj in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    hf_names.append("model.embed_tokens.weight" if tied else "lm_head.weight")
    weights = []
    for seed, name in enumerate(hf_names):
        fused, _ = param_shard(name)
        rows = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "gate_proj": 128, "up_proj": 128}.get(
            name.split(".")[-2], shapes[fused][0])
        format = "q4_1" if ".mlp." in name else "q8_0"
        if name == "model.layers.1.self_attn.v_proj.weight":
            format = "q4_1"  # layer 1's q|k|v mixes formats
        if name != "model.layers.1.mlp.up_proj.weight":  # layer 1's gate|up misses a shard
            weights.append((name, quant.from_gguf(format, random_gguf_blocks(format, rows, shapes[fused][1], seed))))
    incomplete = "model.layers.1.mlp.gate_up_proj"
    assert load_quantized_weights(quantized, weights) == 2 * 4 + 1 - 1
    assert quantized.get_submodule("model.layers.1.self_attn.qkv_proj").quantized is not None
    for module_name, module in quantized.named_modules():
        if not isinstance(module, Linear):
            continue
        if module_name == incomplete:
            assert module.quantized is None and torch.equal(module.weight, dense.get_submodule(incomplete).weight)
            continue
        shards = [w for n, w in weights  # in shard order: hf_names lists q, k, v and gate, up
                  if ("lm_head.weight" if n == "model.embed_tokens.weight" else param_shard(n)[0])
                  == f"{module_name}.weight"]
        assert module.weight is None and shards
        x = torch.randn(3, shards[0].in_features)
        want = torch.nn.functional.linear(x, torch.cat([quant.dequantize(w) for w in shards]), module.bias)
        torch.testing.assert_close(module(x), want, atol=2e-5, rtol=2e-5)

    # The loader's order: blocks first, then the checkpoint, whose moved projections' fp32
    # tensors are skipped (the loader never reads them; load_weights passes over them itself).
    first = load_model(EngineArgs(model=model_dir, load_format="dummy", quantized_activations=False)).model
    assert load_quantized_weights(first, weights) == 2 * 4 + 1 - 1
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        checkpoint = [(name, f.get_tensor(name)) for name in f.keys()]
    skipped = {name for name, _ in checkpoint if on_quantized_blocks(first, name)}
    stay = {"model.embed_tokens.weight", "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    assert skipped == set(hf_names) - stay  # the tied table stays: it is the lookup
    load_weights(first, checkpoint)
    for (name, got), want in zip(first.state_dict().items(), quantized.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    for (name, module), twin in zip(first.named_modules(), quantized.modules(), strict=True):
        if isinstance(module, Linear) and module.quantized is not None:
            x = torch.randn(3, module.quantized.in_features)
            assert torch.equal(module(x), twin(x)), name


@pytest.mark.parametrize("gguf", [True, False])
def test_a_long_prompts_mlp_runs_in_chunks_and_computes_the_same(tiny_model_dir, gguf):
    """A step's tokens beyond MLP_CHUNK_TOKENS go through the MLP in chunks of it: on the
    integer kernel (the default model's blocks) the same bits as whole, since each row is
    quantized and projected on its own; on the dense path (oneDNN, whose blocking follows the
    rows) the same within fp32 rounding."""
    from trillm.model import llama

    runner = ModelRunner(EngineArgs(num_kv_blocks=64)) if gguf else tiny_runner(tiny_model_dir("llama"))
    mlp = runner.model.model.layers[0].mlp
    x = torch.randn(2 * llama.MLP_CHUNK_TOKENS + 37, runner.config.hf_config.hidden_size)
    rows_seen = []
    projection = mlp.gate_up_proj.forward
    mlp.gate_up_proj.forward = lambda rows, *more: rows_seen.append(rows.shape[0]) or projection(rows, *more)
    with torch.inference_mode():
        chunked = mlp(x)
        assert rows_seen == [llama.MLP_CHUNK_TOKENS, llama.MLP_CHUNK_TOKENS, 37]
        whole = mlp.down_proj(mlp.act_and_mul(projection(x)))
    if gguf:
        assert torch.equal(chunked, whole)
    else:
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
