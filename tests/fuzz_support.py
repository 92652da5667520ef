"""The fuzzer of the bad-input test and benchmarks/soak.py (a module, not a test file).

schemathesis reads the server's own /openapi.json and makes, for every POST route, bodies that
fit the schema (which then reach the engine and run) and bodies that break it. It is
synchronous; `fuzz_in_a_process` runs it (and sends the hostile bodies, `hostile_cases`) in a
process of its own while the server serves on the Trio loop: generating cases is pure Python,
and in a thread of the server's process it held the interpreter lock the server's event loop
needs, so a stalled probe could not tell the server's fault from the fuzzer's. Generating is
most of the fuzzer's work, so the routes are dealt to several such processes at once.

Derandomized, so a run repeats exactly: the cases are a function of the document, the budget,
this module and the versions of schemathesis and hypothesis. `fuzz_in_a_process` keeps them
under that key in the cache (TRILLM_CACHE, else ~/.cache/trillm, in fuzz/), and a later run with
the same key sends the kept cases rather than making them again; delete the folder to make them
afresh.
"""
import hashlib
import json
import os
import pickle
import sys
from importlib.metadata import version


def assert_openai_error(status: int, body: dict) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]


# Anthropic's error types by status, as its API documents them (its SDKs map statuses to classes)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def assert_anthropic_error(status: int, body: dict) -> None:
    error = body["error"]
    assert body["type"] == "error" and set(error) == {"type", "message"} and error["message"]
    assert error["type"] == ANTHROPIC_TYPES.get(status, "invalid_request_error"), (status, error)


def assert_error(path: str, status: int, body: dict) -> None:
    """An error body in the shape of the API that `path` belongs to."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        assert_anthropic_error(status, body)
    elif path.startswith("/api/"):  # Ollama's: the message alone
        assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"], (status, body)
    else:
        assert_openai_error(status, body)


def sse_errors(text: str) -> list[dict]:
    """The error events a stream carried (the server reports a mid-stream failure in-band)."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: {")]
    return [e["error"] for e in map(json.loads, events) if "error" in e]


def cases(doc: dict, examples: int, share: tuple[int, int] = (0, 1)) -> list[tuple[str, dict]]:
    """schemathesis's cases for every POST operation of `doc`, bodies valid and invalid, as
    (the operation's path, the `requests` arguments that send the case, its URL without the
    server's address). `share` (k, n): only the k-th of every n operations."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.openapi import from_dict

    made: list[tuple[str, dict]] = []
    schema = from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in [op for op in operations if op.method.upper() == "POST"][share[0]::share[1]]:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(operation.body) else [])
        for mode in modes:

            @settings(
                max_examples=examples, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case):
                arguments = case.as_transport_kwargs(base_url="")
                arguments["headers"].pop("X-Schemathesis-TestCaseId")  # a random id for its logs: not kept
                made.append((operation.path, arguments))

            one()
    return made


def send(url: str, made: list[tuple[str, dict]], counts: dict) -> None:
    """Each case of `cases` (or `hostile_cases`) to the server at `url`; raises on the first 5xx
    or malformed error (OpenAI's shape, Anthropic's and Ollama's on their routes), or a stream that
    carried an error."""
    import requests

    with requests.Session() as session:
        for path, arguments in made:
            response = session.request(**{**arguments, "url": url + arguments["url"]}, timeout=60)
            counts[response.status_code // 100] = counts.get(response.status_code // 100, 0) + 1
            case = str(arguments)[:2000]  # a hostile body is megabytes
            assert response.status_code < 500, (case, response.text[:2000])
            if response.status_code >= 400:
                assert_error(path, response.status_code, response.json())
            elif "text/event-stream" in response.headers.get("content-type", ""):
                assert not sse_errors(response.text), (case, response.text[:2000])


def fuzz(url: str, doc: dict, counts: dict, examples: int, share: tuple[int, int] = (0, 1)) -> None:
    """`cases`, made now, sent to the server at `url` (see `send`)."""
    send(url, cases(doc, examples, share), counts)


def hostile_bodies() -> list[tuple[str, bytes]]:
    """(Content-Type, body) pairs no route may answer with a 5xx: nesting past any parser's
    recursion limit and just past the server's own, a key twice, lists of hundreds of thousands
    of items, integers longer than Python converts (as a value, nested, and inside JSON carried
    as text: a schema, a tool call's arguments), schemas that admit no output (at once, or only
    deeper down), and the media types of a browser's cross-site "simple" request."""
    deep = b'{"model": ' + b"[" * 200 + b"]" * 200 + b"}"
    huge = b"9" * 5_000
    as_text = b'\\"x\\": ' + huge  # inside a JSON string: {"x": 999...}
    return [
        ("application/json", b'{"prompt": "x", "messages": [], "input": "x", "max_tokens": ' + huge + b"}"),
        ("application/json", b'{"prompt": "x", "logit_bias": {"1": [' + huge + b"]}, \"n\": 1}"),
        ("application/json", b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "guided_json": "{'
         + as_text + b'}"}'),
        ("application/json", b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
         b'"function": {"name": "f", "arguments": "{' + as_text + b'}"}}]}, {"role": "user", "content": "x"}]}'),
        *(("application/json", json.dumps({
            "prompt": "x", "messages": [{"role": "user", "content": "x"}], "input": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}}}).encode())
          for schema in ({"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})),
        ("application/json", b"[" * 100_000 + b"]" * 100_000),
        ("application/json", b'{"a": ' * 2_000 + b"1" + b"}" * 2_000),
        ("application/json", deep),
        ("application/json", b'{"model": "a", "model": "b", "prompt": "x", "messages": [], "input": "x"}'),
        ("application/json", b'{"prompt": [' + b'"a",' * 400_000 + b'"a"], "input": [' + b"1," * 300_000 + b"1]}"),
        ("application/json", b'{"messages": [' + b'{"role": "user", "content": "x"},' * 30_000 + b"{}]}"),
        ("text/plain", b'{"prompt": "x", "max_tokens": 1}'),
        ("application/x-www-form-urlencoded", b"prompt=x&abort_all=true"),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n--b--"),
    ]


def hostile_cases(doc: dict, share: tuple[int, int] = (0, 1)) -> list[tuple[str, dict]]:
    """Every hostile body to every POST route of `doc` (path parameters filled with a made-up id),
    as `cases` gives its cases. `share` as `cases`'s."""
    import re

    paths = [re.sub(r"\{[^}]+\}", "resp_none", path) for path, ops in doc["paths"].items() if "post" in ops]
    bodies = hostile_bodies()
    # DNS rebinding: another site's page, its name resolving to the server, sends a Host and an
    # Origin that agree, with a body an admin route would act on.
    rebound = {"Content-Type": "application/json", "Host": "evil.example:8000", "Origin": "http://evil.example:8000"}
    return [(path, {"method": "POST", "url": path, "data": body, "headers": {"Content-Type": content_type}})
            for path in paths[share[0]::share[1]] for content_type, body in bodies] + [
        (path, {"method": "POST", "url": path, "headers": rebound,
                "data": b'{"prompt": "x", "max_tokens": 1, "abort_all": true, "rid": "x"}'})
        for path in paths[share[0]::share[1]]]


async def probe_health(url: str, probes: list[float]) -> None:
    """/health every 50 ms until cancelled, each answer's wait appended to `probes` (a stalled
    event loop shows as a slow answer)."""
    import httpx
    import trio

    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while True:
            start = trio.current_time()
            assert (await client.get("/health")).status_code == 200
            probes.append(trio.current_time() - start)
            await trio.sleep(0.05)


async def fuzz_in_a_process(url: str, examples: int, processes: int = 2) -> dict[int, int]:
    """The cases (kept ones, or made now and kept: see the module's docstring) and then the
    hostile bodies, sent to the server at `url`, the routes dealt to `processes` child processes
    running at once; returns the answers counted by status class. Fails with a child's report on
    a 5xx or a malformed error."""
    import httpx
    import trio

    async with httpx.AsyncClient(timeout=60) as client:
        doc = (await client.get(url + "/openapi.json")).json()
    with open(__file__, "rb") as f:
        key = hashlib.sha256(json.dumps([doc, examples, processes, version("schemathesis"), version("hypothesis"),
                                         f.read().decode()], sort_keys=True).encode()).hexdigest()[:16]
    from trillm.model.conversion import cache_root

    folder = os.path.join(cache_root(), "fuzz")
    os.makedirs(folder, exist_ok=True)
    for stale in [name for name in os.listdir(folder) if not name.startswith(key)]:  # another key's: no run sends them
        os.remove(os.path.join(folder, stale))
    counts: dict[int, int] = {}

    async def one(share: int) -> None:
        kept = os.path.join(folder, f"{key}-{share}.pickle")
        result = await trio.run_process([sys.executable, __file__, url, str(examples), str(share), str(processes),
                                         kept], capture_stdout=True, capture_stderr=True, check=False)
        assert result.returncode == 0, result.stderr.decode(errors="replace")[-4000:]
        for status, count in json.loads(result.stdout.decode().splitlines()[-1]).items():
            counts[int(status)] = counts.get(int(status), 0) + count

    async with trio.open_nursery() as nursery:
        for share in range(processes):
            nursery.start_soon(one, share)
    return counts


def kept_cases(path: str, doc: dict, examples: int, share: tuple[int, int]) -> list[tuple[str, dict]]:
    """The cases kept at `path`, or `cases` made now and kept there."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    made = cases(doc, examples, share)
    with open(path + ".part", "wb") as f:
        pickle.dump(made, f)
    os.replace(path + ".part", path)  # whole or not at all, if two runs make it at once
    return made


if __name__ == "__main__":  # fuzz_in_a_process's child: python fuzz_support.py URL EXAMPLES SHARE PROCESSES KEPT
    import httpx

    target, per_route, share = sys.argv[1], int(sys.argv[2]), (int(sys.argv[3]), int(sys.argv[4]))
    document = httpx.get(target + "/openapi.json", timeout=60).json()
    counted: dict[int, int] = {}
    send(target, kept_cases(sys.argv[5], document, per_route, share) + hostile_cases(document, share), counted)
    print(json.dumps(counted))
