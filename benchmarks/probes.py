"""The held-out probes, run as a set against `trillm serve` as a user starts it (the default model,
keyless, request templates trusted), with what each one found written to a JSON report.

- rebinding: a keyless server's admin routes under a rebound Host and Origin, and a preflight
  from another site, while another client streams;
- huge integers: 5,000-digit integers as values, nested, and inside JSON carried as text, on
  every JSON route;
- oversized prompts: three 7 MB prompts at once beside a live stream (the stream's longest gap
  between tokens, each refusal's time, the server's memory before and after);
- an agent's request: Claude-Code-shaped /v1/messages asking max_tokens 32000;
- slow schemas: two that compile for seconds, then an ordinary one (which answers first);
- request templates: loops and allocations past the render's bounds;
- SIGTERM: streams running, then the time until the process is gone against --drain-timeout.

    python -m benchmarks.probes --out benchmarks/results/probes.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import trio

HUGE = "9" * 5_000
DRAIN_TIMEOUT = 4.0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def stream_gaps(http: httpx.AsyncClient, model: str, tokens: int, gaps: list[float], started: trio.Event):
    """A completion streamed to its end; the gaps between its chunks go to `gaps`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()


async def probe_rebinding(http: httpx.AsyncClient, url: str, model: str) -> dict:
    port = url.rsplit(":", 1)[1]
    evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    gaps, started, found = [], trio.Event(), {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream_gaps, http, model, 64, gaps, started)
        await started.wait()
        found["abort_all"] = (await http.post("/abort_request", json={"abort_all": True}, headers=evil)).status_code
        found["flush_cache"] = (await http.post("/flush_cache", headers=evil)).status_code
        preflight = await http.options("/abort_request", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        found["preflight"] = preflight.status_code  # a browser goes on only after a 2xx preflight
    found["stream_chunks"] = len(gaps) + 1
    found["holds"] = found["abort_all"] == found["flush_cache"] == found["preflight"] == 403 and \
        found["stream_chunks"] >= 64
    return found


async def probe_huge_integers(http: httpx.AsyncClient, model: str) -> dict:
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bodies = {
        "/v1/completions max_tokens": ("/v1/completions", f'{{"model": "{model}", "prompt": "Hi", "max_tokens": {HUGE}}}'),
        "/v1/chat/completions nested": ("/v1/chat/completions",
                                        json.dumps(chat)[:-1] + f', "metadata": {{"a": [{{"b": {HUGE}}}]}}}}'),
        "/v1/chat/completions guided_json text": ("/v1/chat/completions", json.dumps(
            {**chat, "guided_json": f'{{"type": "object", "maxProperties": {HUGE}}}'})),
        "/v1/chat/completions tool-call arguments": ("/v1/chat/completions", json.dumps({**chat, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": f'{{"n": {HUGE}}}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})),
        "/v1/messages": ("/v1/messages", f'{{"model": "{model}", "max_tokens": {HUGE}, "messages": []}}'),
        "/v1/responses": ("/v1/responses", f'{{"model": "{model}", "input": "Hi", "max_output_tokens": {HUGE}}}'),
        "/v1/embeddings": ("/v1/embeddings", f'{{"model": "{model}", "input": [{HUGE}]}}'),
        "/tokenize": ("/tokenize", f'{{"model": "{model}", "prompt": "Hi", "add_special_tokens": {HUGE}}}'),
        "/api/chat": ("/api/chat", f'{{"model": "{model}", "messages": [], "options": {{"num_predict": {HUGE}}}}}'),
        "/generate": ("/generate", f'{{"text": "Hi", "sampling_params": {{"max_new_tokens": {HUGE}}}}}'),
    }
    found = {}
    for name, (path, body) in bodies.items():
        response = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        found[name] = response.status_code
    # JSON carried as text that the server never needs to read (a tool call's arguments shown to a
    # template that takes text) stays text: a 200 there is the prompt, not a failure.
    return {"status": found, "holds": all(s < 500 for s in found.values())}


async def probe_oversized_prompts(http: httpx.AsyncClient, model: str, pid: int) -> dict:
    before = rss_mib(pid)
    gaps, started, refusals = [], trio.Event(), []
    prompt = "word " * ((7 << 20) // 5)

    async def oversized() -> None:
        start = time.monotonic()
        response = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
        refusals.append((response.status_code, time.monotonic() - start))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream_gaps, http, model, 96, gaps, started)
        await started.wait()
        for _ in range(3):
            nursery.start_soon(oversized)
    return {"refusals": [{"status": s, "seconds": round(t, 3)} for s, t in refusals],
            "longest_gap_s": round(max(gaps), 3), "rss_before_mib": round(before), "rss_after_mib": round(rss_mib(pid)),
            "holds": all(s == 400 and t < 1.0 for s, t in refusals) and max(gaps) < 0.5}


async def probe_agent(http: httpx.AsyncClient, model: str) -> dict:
    tools = [{"name": f"tool_{i}", "description": f"Tool number {i}.", "cache_control": {"type": "ephemeral"},
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for i in range(13)]
    body = {"model": model, "max_tokens": 32000, "stream": True, "tools": tools,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Open main.py."}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "tool_0",
                                                   "input": {"path": "main.py"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}]}]}
    events, request_id = [], None
    async with http.stream("POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as response:
        status, request_id = response.status_code, response.headers.get("request-id")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    start = next((e for e in events if e["type"] == "message_start"), {})
    delta = next((e for e in events if e["type"] == "message_delta"), {})
    found = {"status": status, "request_id": bool(request_id),
             "message_start_input_tokens": start.get("message", {}).get("usage", {}).get("input_tokens"),
             "stop_reason": delta.get("delta", {}).get("stop_reason")}
    found["holds"] = (status == 200 and found["request_id"] and (found["message_start_input_tokens"] or 0) > 0
                      and found["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence"))
    return found


def nested_schema(depth: int, tag: str) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{j}": schema for j in range(3)}, "required": ["k0"]}
    schema["properties"][tag] = {"type": "integer"}
    return schema


async def probe_slow_schemas(http: httpx.AsyncClient, model: str) -> dict:
    answered = []

    async def post(name: str, schema: dict) -> None:
        start = time.monotonic()
        response = await http.post("/v1/completions", json={
            "model": model, "prompt": "Hi", "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}})
        answered.append((name, response.status_code, round(time.monotonic() - start, 2)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "slow0", nested_schema(7, "a"))
        nursery.start_soon(post, "slow1", nested_schema(7, "b"))
        await trio.sleep(0.5)
        await post("ordinary", {"type": "object", "properties": {"n": {"type": "integer"}}})
        nursery.cancel_scope.cancel()
    return {"answered": answered, "holds": answered[0][:2] == ("ordinary", 200)}


async def probe_templates(http: httpx.AsyncClient, model: str, pid: int) -> dict:
    before = rss_mib(pid)
    found = {}
    for name, template in {
        "loop 3e8": "{% for i in range(30000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "one 300 MB string": "{{ 'x' * 300000000 }}",
        "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                    "{{ ns.s | length }}",
        "range 10**9": "{% for i in range(10**9) %}{% endfor %}",
        "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    }.items():
        start = time.monotonic()
        response = await http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "chat_template": template})
        found[name] = {"status": response.status_code, "seconds": round(time.monotonic() - start, 2),
                       "message": response.json()["error"]["message"][:100]}
    after = rss_mib(pid)
    return {"templates": found, "rss_before_mib": round(before), "rss_after_mib": round(after),
            "holds": all(f["status"] == 400 and f["seconds"] < 5 for f in found.values()) and after - before < 200}


async def probe_sigterm(http: httpx.AsyncClient, model: str, process: subprocess.Popen) -> dict:
    started = trio.Event()

    async def endless() -> None:
        try:
            await stream_gaps(http, model, 4000, [], started)
        except httpx.HTTPError:
            pass

    async with trio.open_nursery() as nursery:
        for _ in range(16):
            nursery.start_soon(endless)
        await started.wait()
        await trio.sleep(0.5)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        while process.poll() is None:
            await trio.sleep(0.01)
        seconds = time.monotonic() - start
    return {"drain_timeout_s": DRAIN_TIMEOUT, "exit_after_s": round(seconds, 3), "exit_code": process.returncode,
            "holds": seconds <= DRAIN_TIMEOUT and process.returncode == 0}


async def main(out: str) -> None:
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "trillm", "serve", "--port", str(port),
                                "--trust-request-chat-template", "--drain-timeout", str(DRAIN_TIMEOUT)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            report["rebinding"] = await probe_rebinding(http, url, model)
            report["huge_integers"] = await probe_huge_integers(http, model)
            report["oversized_prompts"] = await probe_oversized_prompts(http, model, process.pid)
            report["agent"] = await probe_agent(http, model)
            report["slow_schemas"] = await probe_slow_schemas(http, model)
            report["request_templates"] = await probe_templates(http, model, process.pid)
            report["sigterm"] = await probe_sigterm(http, model, process)
    finally:
        if process.poll() is None:
            process.kill()
    report["all_hold"] = all(r["holds"] for r in report.values())
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/probes.json")
    trio.run(main, parser.parse_args().out)
