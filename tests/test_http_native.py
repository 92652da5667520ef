"""The native endpoints (/generate, /tokenize, /detokenize) and the read-only ones (health,
models, info, load, metrics), and the X-Request-Id contract, against a live server."""
import json

from http_support import live_server, metric_value, settled_stats

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.model.loader import CPU_BATCHED_TOKENS

PROMPT = "The capital of France is"


async def generate(http, text=PROMPT, **body):
    return (await http.post("/generate", json={"text": text, **body})).json()


def sse_payloads(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_generate_whole_streamed_batched_and_with_logprobs(server):
    http = server.http()
    greedy = {"max_new_tokens": 6, "temperature": 0}
    whole = await generate(http, sampling_params=greedy, return_logprob=True, top_logprobs_num=2)
    meta = whole["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert len(whole["output_ids"]) == meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(server.state.engine.core.tokenizer.encode(PROMPT))
    assert whole["text"] == server.state.engine.core.tokenizer.decode(whole["output_ids"])
    assert [t for _, t in meta["output_token_logprobs"]] == whole["output_ids"]
    for top, token in zip(meta["output_top_logprobs"], whole["output_ids"]):
        assert len(top) == 2 and top[0][1] == token, "greedy: the chosen token is the most likely one"

    ids = server.state.engine.core.tokenizer.encode(PROMPT)
    by_ids = (await http.post("/generate", json={"input_ids": ids, "sampling_params": greedy})).json()
    assert by_ids["output_ids"] == whole["output_ids"]

    streamed = (await http.post("/generate", json={"text": PROMPT, "sampling_params": greedy, "stream": True})).text
    streamed = sse_payloads(streamed)
    assert [e["meta_info"]["finish_reason"] for e in streamed[:-1]] == [None] * (len(streamed) - 1)
    texts = [e["text"] for e in streamed]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "each event holds the text so far"
    assert streamed[-1]["text"] == whole["text"] and streamed[-1]["output_ids"] == whole["output_ids"]

    batch = await generate(http, [PROMPT, "Two plus two is"], sampling_params=greedy)
    assert [b["index"] for b in batch] == [0, 1] and batch[0]["output_ids"] == whole["output_ids"]
    samples = await generate(http, sampling_params={"max_new_tokens": 3, "n": 2, "seed": 1})
    assert [s["index"] for s in samples] == [0, 1]


async def test_generate_with_a_stop_string_reports_what_matched(server):
    http = server.http()
    free = await generate(http, sampling_params={"max_new_tokens": 8, "temperature": 0})
    stop = free["text"].split()[1]
    stopped = await generate(http, sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == free["text"][: free["text"].index(stop)]
    assert (await settled_stats(http))["num_used_blocks"] == 0


async def test_tokenize_and_detokenize_round_trip(server):
    http = server.http()
    tokens = (await http.post("/tokenize", json={"prompt": PROMPT})).json()
    assert tokens["tokens"] == server.state.engine.core.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == server.state.engine.core.config.max_model_len
    assert (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json() == {"prompt": PROMPT}
    hi = [{"role": "user", "content": "Hi"}]
    chat = (await http.post("/tokenize", json={"messages": hi, "return_token_strs": True})).json()
    assert len(chat["token_strs"]) == chat["count"] > 3
    answer = await server.openai().chat.completions.create(model=server.model, messages=hi, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens, "tokenize counts what chat completions bills"


async def test_info_endpoints(server):
    http = server.http()
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/ping")).status_code == 200 and (await http.post("/ping")).status_code == 200
    models = (await server.openai().models.list()).data
    assert [m.id for m in models] == [server.model] and models[0].object == "model"
    assert (await server.openai().models.retrieve(server.model)).id == server.model
    info = (await http.get("/model_info")).json()
    assert info["served_model_name"] == server.model and info["max_model_len"] == 8192
    assert info["architectures"] == ["LlamaForCausalLM"] and info["vocab_size"] == 49152
    server_info = (await http.get("/server_info")).json()
    assert server_info["settings"]["engine"]["num_kv_blocks"] == 256 and server_info["settings"]["api_key"] is None
    assert server_info["stats"]["num_kv_blocks"] == 256
    # the step's token budget as the engine resolved it: the CPU's default (no flag given)
    assert server_info["settings"]["engine"]["max_num_batched_tokens"] is None
    assert server_info["max_prefill_tokens"] == CPU_BATCHED_TOKENS == 512
    assert (await http.get("/version")).json()["version"] == "0.1.0"
    assert (await http.get("/load")).json() == {"server_load": 0, "num_requests_running": 0, "num_requests_waiting": 0}


async def test_metrics_use_vllm_names_with_our_prefix(server):
    http = server.http()
    await server.openai().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = (await http.get("/metrics")).text
    for name in (
        "trillm:num_requests_running", "trillm:num_requests_waiting", "trillm:kv_cache_usage_perc",
        "trillm:prefix_cache_queries_total", "trillm:prefix_cache_hits_total", "trillm:prompt_tokens_total",
        "trillm:generation_tokens_total", 'trillm:request_success_total{finished_reason="length"',
        "trillm:time_to_first_token_seconds_bucket", "trillm:inter_token_latency_seconds_bucket",
        "trillm:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


async def test_metrics_can_carry_vllms_own_names(core):
    """What the Gateway API Inference Extension's endpoint picker reads, by vLLM's names: the
    queue, the KV cache's use, and its block size and size in blocks (cache_config_info)."""
    async with live_server(core, metrics_prefix="vllm") as server:
        text = (await server.http().get("/metrics")).text
        cache_info = await metric_value(server.http(), "vllm:cache_config_info", block_size=str(core.args.block_size),
                                        num_gpu_blocks=str(core.stats().num_kv_blocks), enable_prefix_caching="True")
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total"):
        assert name in text, name
    assert cache_info == 1
    assert "trillm:" not in text


async def test_request_id_is_echoed_but_the_response_id_is_the_servers(server):
    raw = await server.openai().completions.with_raw_response.create(
        model=server.model, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "my-id-1"}
    )
    assert raw.headers["X-Request-Id"] == "my-id-1" and raw.parse().id.startswith("cmpl-")
    fresh = await server.openai().completions.with_raw_response.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert fresh.headers["X-Request-Id"] == fresh.parse().id and fresh.parse().id.startswith("cmpl-")
    health = await server.http().get("/health", headers={"X-Request-Id": "probe"})
    assert health.headers["X-Request-Id"] == "probe"


async def test_a_model_without_a_tokenizer_serves_token_ids(tiny_model_dir):
    core = EngineCore(EngineArgs(model=tiny_model_dir(), num_kv_blocks=16))
    assert core.tokenizer is None
    async with live_server(core) as server:
        client, http = server.openai(), server.http()
        out = await client.completions.create(
            model=server.model, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=1
        )
        choice = out.choices[0]
        assert choice.text == "" and out.usage.completion_tokens == 4
        assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
        greedy = {"max_new_tokens": 4, "temperature": 0}
        native = (await http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": greedy})).json()
        assert native["output_ids"] == [int(t.split(":")[1]) for t in choice.logprobs.tokens]
        for path, body, param in (
            ("/v1/completions", {"prompt": "text"}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
            ("/v1/completions", {"prompt": [5, 6], "stop": ["x"]}, "stop"),
            ("/tokenize", {"prompt": "text"}, "prompt"),
            ("/detokenize", {"tokens": [5]}, "tokens"),
        ):
            response = await http.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)
