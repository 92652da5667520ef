"""What the server tests share: a live-server fixture and helpers (a module, not a test file).

One EngineCore per test process: loading the model takes seconds, so every test
file's live servers and AsyncEngines drive the same core, one at a time. Each
live server is real: Hypercorn's trio worker on a loopback port, in the test's
own Trio run, so a test can talk HTTP to it and still read its engine's state.
An app's shutdown aborts whatever still runs, so the core is idle again for the
next test.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import ssl
import subprocess
import threading
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import trio
from hypercorn.trio import serve
from prometheus_client.parser import text_string_to_metric_families
from quart_trio import QuartTrio

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.http.app import create_app
from trillm.launch.serve import hypercorn_config
from trillm.http.settings import ServerSettings
from trillm.http.state import EXTENSION, ServerState
from trillm.model.conversion import cache_root

NUM_KV_BLOCKS = 256  # 4096 tokens: room for every test, small enough to allocate at once
TINY_KV_BLOCKS = 128  # 2048 tokens: fewer than a soak's requests want at once, so some are preempted
TINY_MAX_MODEL_LEN = 96
SETTLE_TIMEOUT = 60  # seconds a test waits for the engine to go idle before failing (not a speed check)


@functools.cache
def shared_core() -> EngineCore:
    """The default model, as `trillm serve` with no --model serves it."""
    return EngineCore(EngineArgs(num_kv_blocks=NUM_KV_BLOCKS))


EXACT = dict(quantized_activations=False, kv_cache_dtype="float32")  # fp32 activations and KV: transformers' numbers


@functools.cache
def exact_core(model_dir: str) -> EngineCore:
    """An engine on the exact path (fp32 activations and KV cache), one per directory per process:
    for tests that compare served numbers with transformers'."""
    return EngineCore(EngineArgs(model=model_dir, num_kv_blocks=64, **EXACT))


@functools.cache
def tiny_core(model_dir: str) -> EngineCore:
    """A tiny random model's engine (tests/conftest.py makes them), one per directory per process.
    A short context bounds what any one request can cost, whatever a fuzzer asks for."""
    return EngineCore(EngineArgs(model=model_dir, num_kv_blocks=TINY_KV_BLOCKS, max_model_len=TINY_MAX_MODEL_LEN))


@functools.cache
def client_tls() -> ssl.SSLContext:
    """One TLS context for the tests' clients. httpx makes one for each client it builds, even
    for a plain-http server like these, and each reads and parses the system's certificates:
    across the suite's clients, seconds of CPU."""
    return ssl.create_default_context()


@dataclass
class LiveServer:
    url: str
    state: ServerState
    app: QuartTrio
    clients: list = field(default_factory=list)  # closed before the server stops, so it need not wait for them

    @property
    def model(self) -> str:
        return self.state.model_name

    def openai(self, **kwargs) -> openai.AsyncOpenAI:
        api_key = kwargs.pop("api_key", "none")
        kwargs.setdefault("http_client", openai.DefaultAsyncHttpxClient(verify=client_tls()))
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)
        self.clients.append(client)
        return client

    def anthropic(self, **kwargs):
        import anthropic

        client = anthropic.AsyncAnthropic(base_url=self.url, api_key=kwargs.pop("api_key", "none"), max_retries=0,
                                          **kwargs)
        self.clients.append(client)
        return client

    def ollama(self, **kwargs):
        import ollama

        client = ollama.AsyncClient(host=self.url, **kwargs)
        self.clients.append(client)
        return client

    def http(self, **kwargs) -> httpx.AsyncClient:
        client = httpx.AsyncClient(base_url=self.url, timeout=SETTLE_TIMEOUT, verify=client_tls(), **kwargs)
        self.clients.append(client)
        return client


@asynccontextmanager
async def live_server(core: EngineCore, **settings):
    server_settings = ServerSettings(**{"port": 0, **settings})
    app = create_app(server_settings, core)
    config = hypercorn_config(server_settings)  # what `trillm serve` runs with
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(functools.partial(serve, app, config, shutdown_trigger=stop.wait))
        server = LiveServer(url, app.extensions[EXTENSION], app)
        try:
            yield server
        finally:
            for client in server.clients:
                await (client.aclose() if isinstance(client, httpx.AsyncClient) else client.close())
            stop.set()


TOKEN_PROMPT = [504, 2115, 282, 4649, 314, 7042, 30, 1370]  # token ids in SmolLM2's vocabulary (tiny text models share it)


async def greedy_ids(client: openai.AsyncOpenAI, model: str, prompt=TOKEN_PROMPT, max_tokens: int = 8,
                     **extra) -> list[int]:
    """A greedy completion's token ids (vLLM's return_token_ids, ignoring EOS); `extra`: more body
    fields. The response must name the model asked for (an adapter's name for an adapter)."""
    out = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


async def finish_of_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int, meanwhile=None, **create):
    """A streamed completion of a token prompt, ignoring EOS, read to its end, and `await
    meanwhile()` once its first chunk came: its finish reason (None if none came), and what
    `meanwhile` returned. `create`: more of create()'s arguments."""
    finish, result, started = [None], [None], trio.Event()

    async def read() -> None:
        chunks = await client.completions.create(model=model, prompt=[10, 11], max_tokens=max_tokens, stream=True,
                                                 extra_body={"ignore_eos": True}, **create)
        async for chunk in chunks:
            started.set()
            finish[0] = chunk.choices[0].finish_reason or finish[0]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await started.wait()
        if meanwhile is not None:
            result[0] = await meanwhile()
    return finish[0], result[0]


async def settled_stats(http: httpx.AsyncClient) -> dict:
    """The engine's stats (read over HTTP) once no request is live any more."""
    with trio.fail_after(SETTLE_TIMEOUT):
        while True:
            stats = (await http.get("/server_info")).json()["stats"]
            if stats["num_live_requests"] == 0:
                return stats
            await trio.sleep(0.02)


async def metric_value(http: httpx.AsyncClient, name: str, **labels) -> float:
    """A sample of /metrics by its full name (`trillm:..._total`), 0 when absent."""
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def metric_total(url: str, name: str, always_reported: bool = False) -> float:
    """The sum of a replica's /metrics samples named `name` over all their labels; 0 before any
    (a labelled counter has no sample until it counts), unless it is `always_reported`."""
    async with httpx.AsyncClient(base_url=url, verify=client_tls()) as http:
        text = (await http.get("/metrics")).text
    values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert values or not always_reported, f"{url} reports no {name}"
    return sum(map(float, values))


async def requests_served(url: str) -> float:
    return await metric_total(url, "trillm:request_success_total")


@contextmanager
def failing_engine(core, after_steps: int = 3):
    """The model raising from every step after its first `after_steps` until the block ends (the
    runner's fault hook): the device gone mid-generation."""
    steps = []

    def fault(sched) -> None:
        steps.append(len(sched.scheduled))
        if len(steps) > after_steps:
            raise RuntimeError("injected fault: the device is gone")

    core.runner.fault_hook = fault
    try:
        yield
    finally:
        core.runner.fault_hook = None


@contextmanager
def frozen_engine(core):
    """The engine held inside its next step until the block ends: nothing it holds can progress."""
    gate = threading.Event()
    core.runner.fault_hook = lambda sched: gate.wait()
    try:
        yield
    finally:
        gate.set()
        core.runner.fault_hook = None


def node_modules(spec: str, package: str) -> str:
    """A node_modules folder holding the npm package `spec` (imported as `package`), installed once
    per machine under trillm's cache; the test skips where node or npm is missing."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    folder = os.path.join(cache_root(), "node", spec.replace("/", "_"))
    if not os.path.isdir(os.path.join(folder, "node_modules", *package.split("/"))):
        os.makedirs(folder, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", folder, spec],
                       check=True, capture_output=True, timeout=300)
    return os.path.join(folder, "node_modules")


async def run_node(script: str, modules: str, *args: str) -> dict:
    """tests/node/`script` run by node with the packages of `modules`, and the one JSON line it
    prints. An ES module resolves packages from its own folder up, not NODE_PATH: a copy of the
    script runs beside a link to them."""
    workdir = os.path.join(os.path.dirname(modules), "run")
    os.makedirs(workdir, exist_ok=True)
    link = os.path.join(workdir, "node_modules")
    if not os.path.exists(link):
        os.symlink(modules, link)
    copy = os.path.join(workdir, script)
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "node", script), copy)
    with trio.fail_after(SETTLE_TIMEOUT):  # a client that hangs fails the test rather than the run
        result = await trio.run_process(["node", copy, *args], capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return json.loads(result.stdout)
