"""What a web page, a gateway or a hostile client cannot make a server do: run a cross-site
"simple" POST (415 for any body that is not JSON), reach the admin routes from another site
without a key (403), load weights or adapters without the operator's opt-in or from outside the
allowed directory (403, the same words whether or not the path exists), register adapters
without bound, learn a file's content from an error, or smuggle a second value of a key past a
gateway (400)."""
from __future__ import annotations

import json
import os
import re
import tempfile

import pytest
import trio

from http_support import TINY_KV_BLOCKS, live_server, tiny_core
from process_support import children

EVIL = "https://evil.example"


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


def completion(server) -> dict:
    return {"model": server.model, "prompt": "Hi", "max_tokens": 1}


async def test_a_body_that_is_not_json_is_415_and_runs_nothing(server):
    http = server.http()
    body = json.dumps(completion(server))
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = await http.post("/v1/completions", content=body, headers={"Content-Type": content_type})
        assert response.status_code == 415, (content_type, response.text)
        assert response.json()["error"]["code"] == 415 and "application/json" in response.json()["error"]["message"]
    bare = await http.post("/v1/completions", content=body.encode(), headers={"Content-Type": ""})
    assert bare.status_code == 415
    # A bodiless admin call from a browser form is refused the same way; JSON with a charset is fine.
    assert (await http.post("/flush_cache", headers={"Content-Type": "application/x-www-form-urlencoded"})
            ).status_code == 415
    ok = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert (await http.post("/flush_cache")).status_code == 200  # no body, no media type: curl -X POST
    assert (await http.get("/server_info")).json()["stats"]["num_steps"] >= 1


async def test_admin_routes_refuse_other_sites_unless_a_key_guards_them(core):
    async with live_server(core) as server:
        http = server.http()
        for headers in ({"Origin": EVIL}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            for path in ("/flush_cache", "/abort_request", "/sleep"):
                response = await http.post(path, json={"abort_all": True} if path == "/abort_request" else None,
                                           headers=headers)
                assert response.status_code == 403, (path, headers, response.text)
                assert "--api-key" in response.json()["error"]["message"]
        # The generation routes stay open to browsers (CORS any origin, as vLLM's defaults), and a
        # browser can read the request id.
        call = await http.post("/v1/completions", json=completion(server), headers={"Origin": EVIL})
        assert call.status_code == 200
        exposed = {h.strip().lower() for h in call.headers["access-control-expose-headers"].split(",")}
        assert "x-request-id" in exposed
        own = await http.post("/flush_cache", headers={"Origin": server.url})  # a page of this server itself
        assert own.status_code == 200
    async with live_server(core, api_key="k-123") as server:
        guarded = await server.http().post("/flush_cache", headers={"Origin": EVIL, "Authorization": "Bearer k-123"})
        assert guarded.status_code == 200


async def test_admin_routes_refuse_a_rebound_host_and_preflights_of_other_origins(core):
    """DNS rebinding: a page of evil.example, its name made to resolve to the server's address,
    sends Host and Origin that agree. Without a key the admin routes answer only a loopback Host,
    the bound address or --allowed-hosts, and preflights only from --admin-origins."""
    async with live_server(core) as server:
        http = server.http()
        port = server.url.rsplit(":", 1)[1]
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        for path in ("/abort_request", "/flush_cache"):
            response = await http.post(path, json={"abort_all": True} if path == "/abort_request" else None,
                                       headers=rebound)
            assert response.status_code == 403 and "--allowed-hosts" in response.json()["error"]["message"]
        for host in ("127.0.0.1", "localhost", "[::1]", "127.8.9.10"):  # loopback by name or address
            assert (await http.post("/flush_cache", headers={"Host": f"{host}:{port}"})).status_code == 200, host
        preflight = {"Origin": EVIL, "Access-Control-Request-Method": "POST"}
        assert (await http.options("/abort_request", headers=preflight)).status_code == 403
        assert (await http.options("/v1/completions", headers=preflight)).status_code == 200  # generation: open
    async with live_server(core, allowed_hosts="llm.lan", admin_origins="https://ui.lan") as server:
        http = server.http()
        port = server.url.rsplit(":", 1)[1]
        assert (await http.post("/flush_cache", headers={"Host": f"llm.lan:{port}"})).status_code == 200
        assert (await http.post("/flush_cache", headers={"Host": f"other.lan:{port}"})).status_code == 403
        ui = {"Origin": "https://ui.lan", "Access-Control-Request-Method": "POST"}
        assert (await http.options("/flush_cache", headers=ui)).status_code == 200
        assert (await http.post("/flush_cache", headers={"Origin": "https://ui.lan"})).status_code == 200


async def test_a_duplicate_key_or_deep_nesting_is_a_400_that_says_so(server):
    http = server.http()
    twice = b'{"model": "other", "model": "%s", "prompt": "Hi", "max_tokens": 1}' % server.model.encode()
    response = await http.post("/v1/completions", content=twice, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "'model' appears twice" in response.json()["error"]["message"]
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    deep = {}
    for _ in range(900):
        deep = {"a": deep}
    cases = [
        ("/v1/completions", "[" * 100_000 + "]" * 100_000),
        ("/v1/chat/completions", json.dumps({**chat, "chat_template_kwargs": deep})),
        ("/v1/chat/completions", json.dumps({**chat, "metadata": {"x": "y"}, "tools": [deep]})),
        ("/v1/responses", json.dumps({"model": server.model, "input": [deep]})),
        ("/generate", "{\"a\": " * 50_000),
    ]
    for path, body in cases:
        response = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (path, response.text[:200])
        assert "nested more than 64 levels" in response.json()["error"]["message"]
    # A tool call's arguments nested too deep reach the template as text, not as a 500.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 900 + "]" * 900}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    response = await http.post("/v1/chat/completions", json={**chat, "messages": messages})
    assert response.status_code == 200, response.text
    # A schema given as text is read as strictly as a body.
    guided = await http.post("/v1/completions", json={**completion(server), "guided_json": '{"type": "object", "type": "x"}'})
    assert guided.status_code == 400 and guided.json()["error"]["param"] == "guided_json"


async def test_long_lists_are_refused_by_their_length(server):
    http = server.http()
    cases = {
        "prompt": (["a"] * 300_000, "at most 2048 prompts"),
        "bad_words": (["w"] * 10_001, "at most 10000 items"),
        "guided_choice": (["c"] * 1025, "at most 1024 items"),
    }
    for field, (value, words) in cases.items():
        body = {**completion(server), field: value}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == field and words in response.json()["error"]["message"]
    items = [{"role": "user", "content": "x"}] * 10_001
    response = await http.post("/v1/responses", json={"model": server.model, "input": items})
    assert response.status_code == 400 and "at most 10000 items" in response.json()["error"]["message"]


async def test_long_lists_of_the_wrong_items_are_refused_by_their_length_not_item_by_item(server):
    """300,000 integers where a union takes a string or a list of strings, or a list of objects:
    the refusal names the list's bound (pydantic checks it first when it sits on the list), where
    each item used to fail every member of the union, an error each, built for seconds holding
    the interpreter lock while the event loop waited. A list of token ids, or logit_bias, unbounded,
    stops at its first bad item."""
    http, model, ints = server.http(), server.model, [1] * 300_000
    user = {"role": "user", "content": "x"}
    chat = {"model": model, "messages": [user]}
    cases = [
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ints}]}, 10_000),
        ("/v1/chat/completions", {**chat, "stop": ints}, 10_000),
        ("/v1/chat/completions", {"model": model, "messages": [user, {"role": "assistant", "tool_calls": ints}]}, 1024),
        ("/v1/chat/completions", {**chat, "functions": ints}, 1024),
        ("/v1/responses", {"model": model, "input": [{"role": "user", "content": ints}]}, 10_000),
        ("/v1/messages", {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": ints}]}]}, 10_000),
        ("/generate", {"text": "x", "rid": ints}, 2048),
        ("/api/embed", {"model": model, "input": ints}, 10_000),
    ]
    for path, body, bound in cases:
        response = await http.post(path, json=body)
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]  # Ollama's error is its message
        # SGLang's /generate refuses a body's schema with a 422, as FastAPI does
        assert response.status_code in (400, 422) and f"at most {bound} items" in message, (path, message[:300])
    biases = dict.fromkeys(map(str, range(100_000)), "x")
    for path, body in (("/detokenize", {"tokens": ["x"] * 300_000}),
                       ("/v1/completions", {**completion(server), "stop_token_ids": ["x"] * 300_000}),
                       ("/v1/completions", {**completion(server), "logit_bias": biases})):
        response = await http.post(path, json=body)
        assert response.status_code in (400, 422) and "more problem" not in response.json()["error"]["message"], path


async def test_weights_and_adapters_from_a_path_are_off_until_asked_for(server, tiny_text_model_dir):
    http = server.http()
    for path, body in (("/update_weights_from_disk", {"model_path": tiny_text_model_dir}),
                       ("/update_weights", {"model_path": tiny_text_model_dir}),
                       ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": tiny_text_model_dir}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        response = await http.post(path, json=body)
        assert response.status_code == 403, (path, response.text)
        assert "--enable-weight-updates" in response.text or "--allow-runtime-lora" in response.text


async def test_paths_outside_the_allowed_directory_get_one_answer(core, tmp_path, tiny_text_model_dir):
    """Inside the allowed directory a path is loaded (and a bad one named for what is wrong);
    outside it, by any route (absolute, `..`, a symlink), the answer is the same 403 whether or not
    anything is there, and never a file's content."""
    root = tmp_path / "weights"
    root.mkdir()
    (root / "escape").symlink_to("/etc")
    odd = root / "odd"
    odd.mkdir()
    (odd / "adapter_config.json").write_text(json.dumps({"peft_type": "SECRET-CONTENT-42", "r": 4}))
    (odd / "adapter_model.safetensors").write_bytes(b"SECRET-CONTENT-43")
    async with live_server(core, enable_weight_updates=True, allowed_weights_dir=str(root)) as server:
        http = server.http()
        answers = set()
        for path in ("/etc", "/proc/self", "/no/such/dir", str(root / ".." / ".."), str(root / "escape"),
                     str(root / "escape" / "passwd"), tiny_text_model_dir, "relative/path"):
            response = await http.post("/update_weights_from_disk", json={"model_path": path})
            assert response.status_code == 403, (path, response.text)
            answers.add(response.json()["error"]["message"])
        assert len(answers) == 1
        inside = await http.post("/update_weights_from_disk", json={"model_path": str(odd)})
        assert inside.status_code == 400 and "no model there" in inside.json()["error"]["message"]
        assert "SECRET" not in inside.text


async def test_runtime_adapters_are_capped_and_their_errors_quote_no_file(tiny_text_model_dir, tmp_path):
    from test_http_lora import lora_core

    from lora_support import make_adapter

    adapter = make_adapter(tiny_text_model_dir, seed=1)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "adapter_config.json").write_text(json.dumps({"peft_type": "SECRET-CONTENT-42", "r": 4}))
    (odd / "adapter_model.safetensors").write_bytes(b"SECRET-CONTENT-43")
    core = lora_core(tiny_text_model_dir, adapter)
    async with live_server(core, allow_runtime_lora=True, allowed_weights_dir=tempfile.gettempdir(),
                           max_lora_adapters=2) as server:
        http, client = server.http(), server.openai()
        try:
            response = await http.post("/v1/load_lora_adapter", json={"lora_name": "odd", "lora_path": str(odd)})
            assert response.status_code == 400 and "not a LoRA adapter" in response.text
            assert "SECRET" not in response.text
            assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapter})
                    ).status_code == 200
            third = await http.post("/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": adapter})
            assert third.status_code == 400 and "--max-lora-adapters" in third.json()["error"]["message"]
            # lora_request's path obeys the same cap and directory
            body = {**completion(server), "lora_request": {"lora_name": "four", "lora_path": adapter}}
            assert (await http.post("/v1/completions", json=body)).status_code == 400
            body["lora_request"]["lora_path"] = "/etc"
            assert (await http.post("/v1/completions", json=body)).status_code == 403
            assert set(core.loras.adapters) == {"one", "two"}
            await client.completions.create(model="two", prompt="Hi", max_tokens=1)
        finally:
            if "two" in core.loras.adapters:
                await server.state.engine.weights.unload_lora("two")


def test_an_opt_in_needs_a_directory(core):
    from trillm.http.app import create_app
    from trillm.http.settings import ServerSettings

    for flags in ({"enable_weight_updates": True}, {"allow_runtime_lora": True}):
        with pytest.raises(ValueError, match="--allowed-weights-dir"):
            create_app(ServerSettings(**flags), core)


def nested_schema(depth: int) -> dict:
    """Objects of three properties each, `depth` deep: under the spec size limit, it compiles for
    seconds (every level multiplies the grammar by three)."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{j}": schema for j in range(3)}, "required": ["k0"]}
    return schema


def grammar_compilers() -> set[int]:
    """The pids of this process's grammar compiler processes."""
    found = set()
    for pid in children(os.getpid()):
        try:
            if b"trillm.engine.grammar_compiler" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.add(pid)
        except FileNotFoundError:  # it ended meanwhile
            pass
    return found


async def test_a_grammar_too_long_or_too_slow_to_compile_is_refused_and_its_compile_stops(tiny_text_model_dir):
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore
    from trillm.engine.structured_output import MAX_SPEC_CHARS

    others = grammar_compilers()  # other engines' in this process
    with EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=TINY_KV_BLOCKS,
                               grammar_compile_timeout=0.3)) as core:
        async with live_server(core) as server:
            http = server.http()
            long = await http.post("/v1/completions", json={**completion(server), "guided_regex": "a" * (MAX_SPEC_CHARS + 1)})
            assert long.status_code == 400 and long.json()["error"]["param"] == "guided_regex"
            assert f"compiles at most {MAX_SPEC_CHARS}" in long.json()["error"]["message"]
            schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(7)}}
            slow = await http.post("/v1/completions", json={**completion(server), "response_format": schema})
            assert slow.status_code == 400 and slow.json()["error"]["param"] == "response_format"
            assert "did not compile within 0.3 s" in slow.json()["error"]["message"]
            # The compile was stopped: its process (a fork of the compiler's) is gone, and the compiler serves on.
            (compiler,) = grammar_compilers() - others
            assert children(compiler) == set()
            out = await server.openai().completions.create(model=server.model, prompt="Hi", max_tokens=4,
                                                           extra_body={"guided_regex": "[0-9]{4}"})
            assert re.fullmatch("[0-9]{4}", out.choices[0].text)
    assert grammar_compilers() <= others, "the compiler process stops with its engine"


async def test_slow_schemas_leave_the_quick_compiles_to_ordinary_ones(tiny_text_model_dir):
    """Two schemas that compile for seconds hold no slot an ordinary schema needs: past the quick
    try they go on one at a time in the slow lane, and the ordinary one is answered first."""
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore
    from trillm.engine.structured_output import COMPILE_SLOTS

    others = grammar_compilers()
    with EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=TINY_KV_BLOCKS,
                               grammar_compile_timeout=60)) as core:
        async with live_server(core) as server:
            http = server.http()
            answered = []

            async def post(name: str, schema: dict) -> None:
                body = {**completion(server), "max_tokens": 3,
                        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}
                response = await http.post("/v1/completions", json=body)
                answered.append((name, response.status_code))

            async with trio.open_nursery() as nursery:
                for i in range(COMPILE_SLOTS):
                    slow = nested_schema(7)
                    slow["properties"][f"lane{i}"] = {"type": "integer"}  # two different specs
                    nursery.start_soon(post, f"slow{i}", slow)
                with trio.fail_after(30):  # both compile: every quick slot is taken
                    while len(compilers := grammar_compilers() - others) != 1 or \
                            len(children(next(iter(compilers)))) < COMPILE_SLOTS:
                        await trio.sleep(0.02)
                await post("ordinary", {"type": "object", "properties": {"n": {"type": "integer"}}})
                assert answered == [("ordinary", 200)], answered
                nursery.cancel_scope.cancel()  # the slow ones' compiles stop with the engine
