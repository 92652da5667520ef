"""The fuzzer of the bad-input test and benchmarks/soak.py (a module, not a test file).

schemathesis reads the server's own /openapi.json and sends, to every POST route, bodies that fit
the schema (which then reach the engine and run) and bodies that break it. It is synchronous:
call `fuzz` in a worker thread while the server serves on the Trio loop. Derandomized, so a run
repeats exactly.
"""
import json

from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.openapi import from_dict


def assert_openai_error(status: int, body: dict) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]


def sse_errors(text: str) -> list[dict]:
    """The error events a stream carried (the server reports a mid-stream failure in-band)."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: {")]
    return [e["error"] for e in map(json.loads, events) if "error" in e]


def fuzz(url: str, doc: dict, counts: dict, examples: int) -> None:
    """Every POST operation, bodies valid and invalid; raises on the first 5xx or malformed error."""
    schema = from_dict(doc)
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST":
            continue
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(operation.body) else [])
        for mode in modes:

            @settings(
                max_examples=examples, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case):
                response = case.call(base_url=url, timeout=60)
                counts[response.status_code // 100] = counts.get(response.status_code // 100, 0) + 1
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400:
                    assert_openai_error(response.status_code, response.json())
                elif "text/event-stream" in response.headers.get("content-type", [""])[0]:
                    assert not sse_errors(response.text), (case.body, response.text)

            one()
