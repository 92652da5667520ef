"""Every way a request can fail, with its status and its OpenAI-shaped body, against a live server.

A client's mistake is a 4xx naming the offending field in `param`; only the server's own
failure (its engine died) is a 5xx, and it is a 503, never a 500.
"""
import openai
import pytest
import trio
from http_support import failing_engine, live_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]
TOO_LONG = [1] * 9000  # token ids: more than the model's 8192-token context


DEFAULT_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error"}


def assert_error(response, status: int, param, error_type: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == (error_type or DEFAULT_TYPES[status])
    return error


BAD_REQUESTS = [
    (CHAT, {"messages": HELLO, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": HELLO, "stop": 5}, 400, "stop"),  # a union's member names stay out of param
    (CHAT, {"messages": 5}, 400, "messages"),
    (CHAT, {"messages": HELLO, "max_tokenz": 5}, 400, "max_tokenz"),
    (CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": HELLO, "n": 0}, 400, "n"),
    (CHAT, {"messages": HELLO, "logit_bias": {"not-a-token": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": HELLO, "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": HELLO, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "regex", "regex": "[z-a]"}}, 400, "response_format"),
    (CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "has space"}}]}, 400,
     "tools.0.function.name"),
    (CHAT, {"messages": HELLO, "tool_choice": "sometimes"}, 400, "tool_choice"),
    (COMPLETIONS, {"prompt": "hi", "response_format": {"type": "ebnf", "ebnf": "root ::= ("}}, 400,
     "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
    (COMPLETIONS, {"prompt": TOO_LONG}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CHAT, {"messages": HELLO, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, 422, "logprob_start_len"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    # a number or a flag sent as a string is refused, as OpenAI refuses it, not read for what it may mean
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": HELLO, "n": "2"}, 400, "n"),
    ("/v1/responses", {"input": "hi", "stream": "true"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 8192}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, 400, "max_new_tokens"),
    # Each of these once got past validation and killed the engine (or left a half-added request).
    (COMPLETIONS, {"prompt": [5, 6], "seed": 2**70}, 400, "seed"),
    (COMPLETIONS, {"prompt": [5, 6], "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": [5, 6], "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 422, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens_new": 4}}, 422, "sampling_params.max_tokens_new"),
    ("/abort_request", {}, 400, "rid"),
    ("/abort_request", {"rid": 5}, 422, "rid"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_request(server, path, body, status, param):
    http = server.http()
    assert_error(await http.post(path, json=body), status, param)
    assert (await http.get("/health")).status_code == 200, "a bad request never hurts the engine"


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity"])
async def test_non_finite_numbers_are_refused(server, field, value):
    """Python's JSON parser accepts NaN and Infinity; no range check catches NaN."""
    body = b'{"prompt": [5, 6], "max_tokens": 2, "%s": %s}' % (field.encode(), value)
    http = server.http()
    response = await http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert "finite" in assert_error(response, 400, field)["message"]
    assert (await http.get("/health")).status_code == 200


async def test_max_tokens_beyond_the_context_is_refused_not_clamped(server):
    """As OpenAI and vLLM answer: the context length and both counts, in a 400 naming max_tokens."""
    client = server.openai()
    prompt = [5] * 100
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=server.model, prompt=prompt, max_tokens=8093)
    assert refused.value.body["param"] == "max_tokens"
    message = refused.value.body["message"]
    assert "8192" in message and "8193" in message and "100 in the prompt" in message and "8093" in message
    exact = await client.completions.create(model=server.model, prompt=prompt, max_tokens=8092, stop=["\n"],
                                            extra_body={"stop_token_ids": list(range(49152))})
    assert exact.usage.completion_tokens == 1, "what fits exactly is taken"
    unbounded = await client.chat.completions.create(model=server.model, messages=HELLO, temperature=0)
    assert unbounded.choices[0].finish_reason == "stop", "no max_tokens: to the end of the context"


async def test_unknown_model_route_method_and_json(server):
    http = server.http()
    assert_error(await http.post(CHAT, json={"model": "gpt-4", "messages": HELLO}), 404, "model")
    assert_error(await http.get("/v1/models/gpt-4"), 404, "model")
    assert_error(await http.get("/v1/nothing-here"), 404, None)
    assert_error(await http.get(CHAT), 405, None, "invalid_request_error")
    assert_error(await http.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"}), 400, None)
    with pytest.raises(openai.NotFoundError):
        await server.openai().chat.completions.create(model="gpt-4", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as bad:
        await server.openai().chat.completions.create(model=server.model, messages=HELLO, temperature=-1)
    assert bad.value.body["param"] == "temperature"


async def test_api_key_guards_what_does_work(core):
    async with live_server(core, api_key="sesame") as server:
        http = server.http()
        error = assert_error(await http.get("/v1/models"), 401, None, "authentication_error")
        assert "Bearer" in error["message"]
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer sesam"})
        assert_error(wrong, 401, None, "authentication_error")
        with pytest.raises(openai.AuthenticationError):
            await server.openai(api_key="wrong").models.list()
        models = await server.openai(api_key="sesame").models.list()
        assert [m.id for m in models.data] == [server.model]
        for open_path in ("/health", "/metrics", "/version"):
            assert (await http.get(open_path)).status_code == 200
        assert_error(await http.post("/generate", json={"text": "hi"}), 401, None, "authentication_error")
        info = (await http.get("/server_info", headers={"Authorization": "Bearer sesame"})).json()
        assert info["settings"]["api_key"] == "<redacted>" and "sesame" not in str(info)


async def test_engine_death_fails_live_requests_and_health_with_503(core):
    """The model crashing mid-generation, injected through the runner's fault hook: every
    in-flight request (streamed or not) fails with the cause, their blocks go back to the pool,
    /health goes 503, new requests get 503, and the server still shuts down."""
    with failing_engine(core):
        async with live_server(core) as server:
            client = server.openai()
            stream = await client.chat.completions.create(
                model=server.model, messages=HELLO, max_tokens=100, stream=True, extra_body={"ignore_eos": True},
            )
            failures = []

            async def whole() -> None:
                with pytest.raises(openai.InternalServerError) as failed:
                    await client.completions.create(
                        model=server.model, prompt="Hi", max_tokens=100, extra_body={"ignore_eos": True}
                    )
                failures.append(failed.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(whole)
                with pytest.raises(openai.APIError) as failed:
                    async for _ in stream:
                        pass
            assert "engine stopped" in failed.value.message and "injected fault" in failed.value.message
            assert failures[0].status_code == 503 and "injected fault" in failures[0].message
            health = await server.http().get("/health")
            assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable_error"
            with pytest.raises(openai.InternalServerError) as refused:
                await client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=2)
            assert refused.value.status_code == 503
            assert core.stats().num_used_blocks == 0 and not core.has_unfinished(), "the dead engine freed them"
