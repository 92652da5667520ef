"""Ollama's API, judged by the official `ollama` Python client (and its JavaScript client) against a
live server on the default model: list, show, ps, version, chat whole and streamed, generate (templated,
raw, with context), a tool round trip, structured output, embed, the options, and the errors."""
import json
import os

import jsonschema
import ollama
import pytest

import trillm
from http_support import TINY_MAX_MODEL_LEN, live_server, node_modules, run_node, settled_stats, tiny_core
from trillm.model.loader import default_model_path

# Asks for more than num_predict tokens: a question whose greedy answer fits in 12 ends with "stop"
# on one CPU's rounding and "length" on another's.
QUESTION = [{"role": "user", "content": "Name ten colors."}]
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}
# Two earlier rounds of a call and its result: after them, the small default model calls the tool itself.
WEATHER_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "Sunny, 24 C.", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is sunny in Paris, 24 C."},
] * 2


async def test_list_show_ps_and_version_describe_the_served_file(server):
    client = server.ollama()
    (listed,) = (await client.list()).models
    tagged = f"{server.model}:latest"
    assert listed.model == tagged and listed.size == os.path.getsize(default_model_path())
    details = listed.details
    assert (details.format, details.family, details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert details.parameter_size == "134.52M" and len(listed.digest) == 64
    shown = await client.show(tagged)
    assert shown.details == details and "completion" in shown.capabilities and "tools" in shown.capabilities
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["general.parameter_count"] == 134_515_008
    assert info["llama.context_length"] == 8192 and info["tokenizer.ggml.tokens"] == []
    assert "num_ctx 8192" in shown.parameters and '"<|im_end|>"' in shown.parameters
    assert shown.template == server.state.chat_template
    (running,) = (await client.ps()).models
    assert running.model == tagged and running.context_length == server.state.max_model_len
    assert running.size_vram == 0 and running.digest == listed.digest
    assert (await server.http().get("/api/version")).json() == {"version": trillm.__version__}
    with pytest.raises(ollama.ResponseError) as missing:
        await client.show("llama3.2")
    assert missing.value.status_code == 404 and missing.value.error == "model 'llama3.2' not found"


async def test_a_chat_is_the_openai_chat_with_ollamas_statistics(server):
    """Greedy text through /api/chat equals /v1/chat/completions; the counts are the usage's, the
    durations nanoseconds that add up."""
    answer = await server.ollama().chat(server.model, messages=QUESTION, options=GREEDY)
    chat = await server.openai().chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12,
                                                         temperature=0)
    assert answer.message.role == "assistant" and answer.message.content == chat.choices[0].message.content
    assert answer.done and answer.done_reason == chat.choices[0].finish_reason == "length"
    assert answer.model == server.model and answer.created_at.endswith("Z")
    assert answer.prompt_eval_count == chat.usage.prompt_tokens and answer.eval_count == chat.usage.completion_tokens
    assert 0 < answer.prompt_eval_duration < answer.total_duration and 0 < answer.eval_duration < answer.total_duration
    assert answer.prompt_eval_duration + answer.eval_duration <= answer.total_duration


async def test_a_streamed_chat_is_ndjson_whose_pieces_join_to_the_whole(server):
    client = server.ollama()
    whole = await client.chat(server.model, messages=QUESTION, options=GREEDY)
    parts = [part async for part in await client.chat(server.model, messages=QUESTION, options=GREEDY, stream=True)]
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].message.content == ""
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == "length"
    assert all(p.eval_count is None for p in parts[:-1])
    async with server.http().stream("POST", "/api/chat", json={"model": server.model, "messages": QUESTION,
                                                               "options": GREEDY}) as response:
        assert response.headers["content-type"] == "application/x-ndjson"  # streamed unless told not to
        lines = [json.loads(line) async for line in response.aiter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content


async def test_generate_templated_raw_and_with_context(server):
    """A prompt goes through the chat template as one user turn after `system` (the chat's text);
    `raw` is the prompt as it is (the completion's text); the `context` an answer returns carries
    the conversation on into the next prompt."""
    client = server.ollama()
    generated = await client.generate(server.model, QUESTION[0]["content"], system="Answer briefly.", options=GREEDY)
    chatted = await client.chat(server.model, options=GREEDY, messages=[
        {"role": "system", "content": "Answer briefly."}, *QUESTION])
    assert generated.response == chatted.message.content and generated.prompt_eval_count == chatted.prompt_eval_count
    assert len(generated.context) == generated.prompt_eval_count + generated.eval_count
    followed = await client.generate(server.model, "And two more.", context=generated.context, options=GREEDY)
    alone = await client.generate(server.model, "And two more.", options=GREEDY)
    assert followed.prompt_eval_count == len(generated.context) + alone.prompt_eval_count
    raw = await client.generate(server.model, "The sky is", raw=True, options={"temperature": 0, "num_predict": 6})
    completion = await server.openai().completions.create(model=server.model, prompt="The sky is", max_tokens=6,
                                                          temperature=0)
    assert raw.response == completion.choices[0].text and raw.context is None
    loaded = await client.generate(server.model)  # nothing to generate: Ollama's "the model is loaded"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_a_tool_round_trip(server):
    """The model's call comes whole, its arguments an object, in the stream's one chunk as in the
    whole answer; the call and its result go back as the next turns."""
    client = server.ollama()
    ask = [*WEATHER_SHOT, {"role": "user", "content": "What is the weather in Tokyo?"}]
    called = await client.chat(server.model, messages=ask, tools=[WEATHER], options={"temperature": 0})
    (call,) = called.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Tokyo"}
    assert called.done_reason == "stop"
    parts = [p async for p in await client.chat(server.model, messages=ask, tools=[WEATHER],
                                                options={"temperature": 0}, stream=True)]
    assert [p.message.tool_calls for p in parts if p.message.tool_calls] == [[call]]
    answered = await client.chat(server.model, tools=[WEATHER], options=GREEDY, messages=[
        *ask, called.message, {"role": "tool", "content": "Rain, 12 C.", "tool_name": "get_weather"}])
    assert answered.message.content and not answered.message.tool_calls


async def test_structured_output_by_schema_and_by_json(server):
    client = server.ollama()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    person = await client.chat(server.model, messages=[{"role": "user", "content": "Give me a person."}],
                               format=schema, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(person.message.content), schema)
    anything = await client.generate(server.model, "Give me a person.", format="json",
                                     options={"temperature": 0, "num_predict": 60})
    assert anything.done_reason == "stop" and isinstance(json.loads(anything.response), dict)


async def test_embed_is_the_openai_embedding_and_embeddings_the_pooled_vector(server):
    client = server.ollama()
    embedded = await client.embed(server.model, input=["red", "green"])
    openai_vectors = await server.openai().embeddings.create(model=server.model, input=["red", "green"])
    for ours, theirs in zip(embedded.embeddings, openai_vectors.data, strict=True):
        assert ours == pytest.approx(theirs.embedding, abs=1e-6)
    assert embedded.prompt_eval_count == openai_vectors.usage.prompt_tokens
    short = await client.embed(server.model, input="red", dimensions=8)
    assert len(short.embeddings[0]) == 8 and sum(x * x for x in short.embeddings[0]) == pytest.approx(1, abs=1e-5)
    pooled = (await server.http().post("/pooling", json={"model": server.model, "input": "red"})).json()
    assert (await client.embeddings(server.model, prompt="red")).embedding == pytest.approx(
        pooled["data"][0]["data"], abs=1e-6)


async def test_embed_truncates_to_the_context_unless_told_not_to(tiny_text_model_dir):
    async with live_server(tiny_core(tiny_text_model_dir)) as server:  # a context of TINY_MAX_MODEL_LEN tokens
        client = server.ollama()
        long = "red " * (2 * TINY_MAX_MODEL_LEN)
        truncated = await client.embed(server.model, input=long)  # truncate is true by default
        assert truncated.prompt_eval_count == TINY_MAX_MODEL_LEN - 1 and len(truncated.embeddings) == 1
        loaded_options = await client.embed(server.model, input=long, options={"num_thread": 2})  # change nothing
        assert loaded_options.embeddings == truncated.embeddings
        with pytest.raises(ollama.ResponseError) as refused:
            await client.embed(server.model, input=long, truncate=False)
        assert refused.value.status_code == 400 and "more than this model's context holds" in refused.value.error


async def test_options_are_honoured_or_refused_by_name(server):
    client = server.ollama()
    capped = await client.chat(server.model, messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert capped.eval_count == 3 and capped.done_reason == "length"
    whole = await client.chat(server.model, messages=QUESTION, options=GREEDY)
    word = whole.message.content.split()[2]
    stopped = await client.chat(server.model, messages=QUESTION, options={**GREEDY, "stop": [word]})
    assert stopped.done_reason == "stop" and whole.message.content.startswith(stopped.message.content)
    assert word not in stopped.message.content
    # num_ctx bounds prompt and answer together
    bounded = await client.chat(server.model, messages=QUESTION,
                                options={"temperature": 0, "num_ctx": whole.prompt_eval_count + 2})
    assert bounded.eval_count == 2 and bounded.done_reason == "length"
    sampled = [await client.chat(server.model, messages=QUESTION, options={"seed": 7, "temperature": 1.0,
                                                                          "num_predict": 8}) for _ in range(2)]
    assert sampled[0].message.content == sampled[1].message.content
    # options that choose how Ollama loads a model change nothing; neutral values of unrun sampling are fine
    same = await client.chat(server.model, messages=QUESTION, keep_alive="5m", options={
        **GREEDY, "num_gpu": 99, "num_thread": 4, "use_mmap": True, "mirostat": 0, "typical_p": 1.0})
    assert same.message.content == whole.message.content
    for options, field in (({"mirostat": 2}, "options.mirostat"), ({"typical_p": 0.5}, "options.typical_p"),
                           ({"repeat_penalty": 1.2, "repeat_last_n": 64}, "options.repeat_last_n"),
                           ({"num_ctx": 10 ** 6}, "options.num_ctx"), ({"num_predict": "5"}, "options.num_predict"),
                           ({"nonsense": 1}, "options.nonsense"), ({"temperature": -1}, "options.temperature")):
        with pytest.raises(ollama.ResponseError) as refused:
            await client.chat(server.model, messages=QUESTION, options=options)
        assert refused.value.status_code == 400 and field in refused.value.error, (options, refused.value.error)


async def test_errors_are_ollamas_shape(server):
    http = server.http()
    for body, status, words in (
        ({"messages": QUESTION}, 400, "model is required"),
        ({"model": "llama3.2", "messages": QUESTION}, 404, "model 'llama3.2' not found"),
        ({"model": server.model, "messages": QUESTION, "think": True}, 400, "does not support thinking"),
        ({"model": server.model, "messages": [{**QUESTION[0], "images": ["aGk="]}]}, 400, "takes text only"),
        ({"model": server.model, "messages": QUESTION, "format": "yaml"}, 400, "format"),
        ({"model": server.model, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ):
        response = await http.post("/api/chat", json=body)
        assert response.status_code == status and list(response.json()) == ["error"], response.text
        assert words in response.json()["error"]
    for body, words in (({"model": server.model, "prompt": "x", "suffix": "y"}, "insert"),
                        ({"model": server.model, "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
                        ({"model": server.model, "prompt": "x", "raw": True, "system": "s"}, "raw"),
                        ({"model": server.model, "context": [10 ** 9]}, "vocabulary")):
        response = await http.post("/api/generate", json=body)
        assert response.status_code == 400 and words in response.json()["error"], response.text
    broken = await http.post("/api/chat", content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and list(broken.json()) == ["error"]
    empty = await server.ollama().chat(server.model, messages=[])
    assert empty.done_reason == "load"


async def test_the_api_key_guards_ollamas_routes(core):
    async with live_server(core, api_key="sk-ollama") as server:
        with pytest.raises(ollama.ResponseError) as refused:
            await server.ollama().list()
        assert refused.value.status_code == 401
        keyed = server.ollama(headers={"Authorization": "Bearer sk-ollama"})
        assert (await keyed.list()).models


async def test_a_client_that_leaves_frees_its_blocks(server):
    http = server.http()
    async with http.stream("POST", "/api/chat", json={"model": server.model, "messages": QUESTION,
                                                      "options": {"num_predict": 4000}}) as response:
        async for line in response.aiter_lines():
            if line:
                break
        assert (await http.get("/server_info")).json()["stats"]["num_used_blocks"] > 0
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["num_live_requests"] == 0


async def test_the_javascript_client(server):
    modules = node_modules("ollama@0.6.4", "ollama")
    out = await run_node("ollama_client.mjs", modules, server.url, server.model)
    assert [m["model"] for m in out["listed"]["models"]] == [f"{server.model}:latest"]
    assert out["details"]["format"] == "gguf" and out["chat"]["done"] and out["chat"]["message"]["content"]
    assert out["streamed"] == out["chat"]["message"]["content"] and out["last"]["done"]
    assert out["last"]["eval_count"] == out["chat"]["eval_count"] and out["generated"]["response"]
    assert [c["function"] for c in out["calls"]] == [{"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}}]
    assert out["answered"]["content"] and not out["answered"].get("tool_calls")
    assert isinstance(out["person"]["name"], str) and isinstance(out["person"]["age"], int)
    assert out["embedded"] == [576, 576]
    assert out["missing"]["status"] == 404 and "not found" in out["missing"]["message"]



async def test_think_splits_the_reasoning_out_with_a_reasoning_parser(core):
    """deepseek_r1 reads the whole of this model's output as reasoning (its template is taken to
    open <think>): it comes as `thinking`, whole and streamed, and show lists the capability."""
    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        client = server.ollama()
        assert "thinking" in (await client.show(server.model)).capabilities
        answer = await client.chat(server.model, messages=QUESTION, think=True, options=GREEDY)
        assert answer.message.thinking and answer.message.content == "" and answer.eval_count == 12
        parts = [p async for p in await client.chat(server.model, messages=QUESTION, think="high", options=GREEDY,
                                                    stream=True)]
        assert "".join(p.message.thinking or "" for p in parts) == answer.message.thinking
