"""Structured logs: every line the server logs while handling a request names that request's id,
from the route to the end of its stream, even with other requests interleaved."""
import logging

import pytest
import trio
from http_support import live_server, tiny_core

from trillm.http.logs import RequestIdFilter


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


async def test_every_line_about_a_request_names_it(core, caplog):
    caplog.set_level(logging.INFO, logger="trillm")
    caplog.handler.addFilter(RequestIdFilter())
    async with live_server(core) as server:
        client, http = server.openai(), server.http()

        async def stream(rid: str) -> None:
            chunks = await client.completions.create(
                model=server.model, prompt=[5, 6, 7], max_tokens=6, stream=True,
                extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": rid},
            )
            async for _ in chunks:
                pass

        async with trio.open_nursery() as nursery:
            for rid in ("trace-a", "trace-b"):
                nursery.start_soon(stream, rid)
        bad = await http.post("/v1/completions", json={"prompt": [5], "n": 0}, headers={"X-Request-Id": "trace-bad"})
        assert bad.status_code == 400
    http_records = [r for r in caplog.records if r.name.startswith("trillm.http")]
    by_id = {}
    for record in http_records:
        assert record.request_id != "-", f"a line with no request id: {record.getMessage()}"
        by_id.setdefault(record.request_id, []).append(record.getMessage())
    assert set(by_id) == {"trace-a", "trace-b", "trace-bad"}, by_id
    for rid in ("trace-a", "trace-b"):
        assert any("length after 6 tokens" in m for m in by_id[rid]) and any("-> 200" in m for m in by_id[rid])
    assert by_id["trace-bad"] == ["POST /v1/completions -> 400"]
