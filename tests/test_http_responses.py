"""The Responses API, judged by the real `openai` SDK (responses.create, responses.stream,
retrieve, input_items, delete, cancel) against a live server on the default model."""
import json

import openai
import pytest
import trio

from fuzz_support import assert_openai_error
from http_support import frozen_engine, live_server, settled_stats

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


async def test_text_response_with_usage_and_the_same_answer_as_chat(server):
    client = server.openai()
    response = await client.responses.create(
        model=server.model, input="Name three colors.", instructions="Answer briefly.", max_output_tokens=12,
        temperature=0, metadata={"purpose": "test"},
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.model == server.model
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and response.output_text == message.content[0].text
    chat = await client.chat.completions.create(
        model=server.model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}],
    )
    assert response.output_text == chat.choices[0].message.content
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert response.metadata == {"purpose": "test"}
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


async def test_max_output_tokens_makes_an_incomplete_response(server):
    response = await server.openai().responses.create(
        model=server.model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell a long story."}]}],
        max_output_tokens=3, temperature=0,
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


async def test_json_schema_text_format_is_enforced(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    response = await server.openai().responses.create(
        model=server.model, input="Invent a person.", max_output_tokens=100, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )
    assert response.status == "completed"
    person = json.loads(response.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert response.text.format.type == "json_schema"


async def test_a_forced_function_call_then_its_output_in_a_second_turn(server):
    client = server.openai()
    first = await client.responses.create(
        model=server.model, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert "city" in json.loads(call.arguments) and first.status == "completed"
    second = await client.responses.create(
        model=server.model, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": "21 C"}'}],
        tool_choice="none",
    )
    assert second.previous_response_id == first.id and second.output_text
    # The earlier turn is replayed as the prompt: the same conversation as chat sees it.
    chat = await client.chat.completions.create(model=server.model, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": "21 C"}'},
    ])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


async def test_a_two_turn_chain_by_previous_response_id_reads_as_one_conversation(server):
    client = server.openai()
    first = await client.responses.create(model=server.model, input="My name is Ada.", max_output_tokens=8,
                                          temperature=0)
    second = await client.responses.create(model=server.model, input="What is my name?", max_output_tokens=8,
                                           temperature=0, previous_response_id=first.id)
    chat = await client.chat.completions.create(model=server.model, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


async def test_stream_events_and_the_final_response(server):
    client = server.openai()
    # The SDK's final response needs response.completed: an answer that ends by itself.
    args = dict(model=server.model, input="Say hello.", max_output_tokens=64, temperature=0)
    whole = await client.responses.create(**args)
    assert whole.status == "completed"
    async with client.responses.stream(**args) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in types, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_stream_raw_lines_carry_event_names(server):
    lines = []
    async with server.http().stream("POST", "/v1/responses", json={
        "model": server.model, "input": "Weather in Rome?", "max_output_tokens": 40, "stream": True,
        "temperature": 0,  # sampled, the unbounded city string could outrun max_output_tokens
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}) as response:
        async for line in response.aiter_lines():
            lines.append(line)
    events = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert len(events) == len(datas) and events == [d["type"] for d in datas]
    assert "response.function_call_arguments.done" in events and "[DONE]" not in lines
    arguments = "".join(d["delta"] for d in datas if d["type"] == "response.function_call_arguments.delta")
    (done,) = [d for d in datas if d["type"] == "response.function_call_arguments.done"]
    assert arguments == done["arguments"] and "city" in json.loads(arguments)
    assert datas[-1]["response"]["output"][0]["arguments"] == arguments


async def test_retrieve_input_items_delete_and_store_false(server):
    client = server.openai()
    response = await client.responses.create(
        model=server.model, max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": "One"}, {"role": "user", "content": "Two"}],
    )
    again = await client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    items = await client.responses.input_items.list(response.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["One", "Two"] and all(i.id for i in items.data)
    deleted = (await server.http().delete(f"/v1/responses/{response.id}")).json()
    assert deleted == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    unstored = await client.responses.create(model=server.model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model=server.model, input="Hi", previous_response_id="resp_nope")
    assert "resp_nope" in str(missing.value)


async def test_a_background_response_can_be_cancelled_and_frees_its_blocks(server):
    http = server.http()
    results = {}

    async def cancel(response_id):
        results["cancel"] = (await http.post(f"/v1/responses/{response_id}/cancel")).json()

    async with trio.open_nursery() as nursery:
        with frozen_engine(server.state.engine.core):  # it cannot finish before the cancel
            created = (await http.post("/v1/responses", json={
                "model": server.model, "input": "Count to a thousand.", "max_output_tokens": 500, "background": True,
            })).json()
            assert created["status"] == "queued" and created["background"] is True
            running = (await http.get(f"/v1/responses/{created['id']}")).json()
            assert running["status"] in ("queued", "in_progress")
            nursery.start_soon(cancel, created["id"])
            await trio.sleep(0.2)
            assert "cancel" not in results  # it answers once the response has ended
    assert results["cancel"]["status"] == "cancelled" and results["cancel"]["usage"]["output_tokens"] < 500
    assert (await http.get(f"/v1/responses/{created['id']}")).json()["status"] == "cancelled"
    again = await http.post(f"/v1/responses/{created['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["num_live_requests"] == 0


async def test_a_deleted_background_response_stays_deleted_once_it_ends(server):
    http = server.http()
    with frozen_engine(server.state.engine.core):  # it cannot finish before the delete
        created = (await http.post("/v1/responses", json={
            "model": server.model, "input": "Count to a thousand.", "max_output_tokens": 500, "background": True,
        })).json()
        assert (await http.delete(f"/v1/responses/{created['id']}")).status_code == 200
    stats = await settled_stats(http)  # it has ended (aborted)
    assert stats["num_live_requests"] == 0
    assert (await http.get(f"/v1/responses/{created['id']}")).status_code == 404


async def test_abort_request_and_a_disconnect_end_a_streaming_response(server):
    http = server.http()
    body = {"model": server.model, "input": "Count to a thousand.", "max_output_tokens": 1000, "stream": True}
    seen, deltas = [], 0
    async with http.stream("POST", "/v1/responses", json=body) as response:
        async for line in response.aiter_lines():
            seen.append(line)
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                deltas += 1
                if deltas == 1:
                    rid = json.loads(seen[1][6:])["response"]["id"]
                    # Held inside its next step, the engine cannot end the answer first: a sampled
                    # answer may be a few tokens long, and a decode step takes milliseconds.
                    with frozen_engine(server.state.engine.core):
                        assert (await http.post("/abort_request", json={"rid": rid})).status_code == 200
    last = json.loads([s for s in seen if s.startswith("data: ")][-1][6:])
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled"
    with trio.move_on_after(2):
        async with http.stream("POST", "/v1/responses", json=body) as response:
            async for _ in response.aiter_lines():
                pass
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["num_live_requests"] == 0


@pytest.mark.parametrize("body, status, param", [
    ({"input": "Hi", "background": True, "store": False}, 400, "background"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
     "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": [{"role": "wizard", "content": "Hi"}]}, 400, None),
    ({"input": "Hi", "model": "other"}, 404, "model"),
])
async def test_bad_responses_requests_are_4xx_naming_the_field(server, body, status, param):
    response = await server.http().post("/v1/responses", json={"model": server.model, **body})
    assert response.status_code == status, response.text
    assert_openai_error(status, response.json())
    if param is not None:
        assert response.json()["error"]["param"] == param
    for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
        missing = await server.http().get(path)
        assert missing.status_code == 404 and "resp_nope" in missing.json()["error"]["message"]


async def test_reasoning_items_with_a_reasoning_parser(core):
    # deepseek_r1 reads the output as reasoning until </think>, which this model never writes:
    # the whole answer is a reasoning item, streamed as reasoning_text events.
    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        client = server.openai()
        args = dict(model=server.model, input="Say hello.", max_output_tokens=12, temperature=0,
                    reasoning={"effort": "low"})
        whole = await client.responses.create(**args)
        (item,) = whole.output
        assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
        chat = await client.chat.completions.create(model=server.model, max_tokens=12, temperature=0,
                                                    messages=[{"role": "user", "content": "Say hello."}])
        assert item.content[0].text == chat.choices[0].message.reasoning_content
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
        assert whole.reasoning.effort == "low"
        events = [e async for e in await client.responses.create(**args, stream=True)]
        types = [e.type for e in events]
        assert "response.reasoning_text.done" in types and "response.output_text.delta" not in types
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == item.content[0].text == events[-1].response.output[0].content[0].text
