"""Keep-alive connections after a response that went out before its request's body came in.

httpx (so the `openai` SDK, litellm, langchain) writes a request's headers and its body in two
TCP writes. An unknown route's 404, a wrong method's 405, a missing key's 401 or a 413 is
answered from the headers alone. Each response on a connection must then be followed by a
correct answer to the next request on it, or by a clean close: never by silence (see
trillm/http/connection.py for why there was silence).
"""
import contextlib
import functools
import json
from contextlib import asynccontextmanager

import openai
import pytest
import trio
from http_support import live_server, tiny_core

KEY = "sesame-0123456789"
MAX_BODY = 4096
NEXT_ANSWER_TIMEOUT = 20  # seconds: far above an answer's time, far below a client's own timeout


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def head(method: str, path: str, body: bytes, **headers) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_response(stream: trio.SocketStream, buffer: bytearray) -> tuple[int, dict, bytes] | None:
    """One whole response (status, lowercased headers, body), or None if the server closed the
    connection first (EOF or a reset: either is a clean close)."""
    try:
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some()
            if not data:
                return None
            buffer += data
        head_bytes, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        status_line, *header_lines = head_bytes.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
        length = int(headers["content-length"])
        while len(rest) < length:
            data = await stream.receive_some()
            if not data:
                return None
            rest += data
    except trio.BrokenResourceError:
        return None
    del buffer[: len(head_bytes) + 4 + length]
    return int(status_line.split()[1]), headers, rest[:length]


async def send_then_next(url: str, first: tuple[bytes, bytes], *, body_after_response: bool):
    """Send `first` (headers, body) on a fresh connection in two writes, the body 10 ms after the
    headers or only once the response is in; then a valid chat request on the same connection.
    Returns the first response and what came of the second: a response, or None for a close."""
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    buffer = bytearray()
    with trio.fail_after(NEXT_ANSWER_TIMEOUT):
        stream = await trio.open_tcp_stream(*host_port(url))
        async with stream:
            await stream.send_all(first[0])
            if not body_after_response:
                await trio.sleep(0.01)
                await stream.send_all(first[1])
            response = await read_response(stream, buffer)
            try:
                if body_after_response:
                    await stream.send_all(first[1])
                await stream.send_all(head("POST", "/v1/chat/completions", chat, Authorization=f"Bearer {KEY}") + chat)
            except trio.BrokenResourceError:
                return response, None
            return response, await read_response(stream, buffer)


EARLY_ANSWERS = [  # each answered from the headers alone
    ("POST", "/v1/responses-nowhere", {"Authorization": f"Bearer {KEY}"}, 404),
    ("POST", "/v1/models", {"Authorization": f"Bearer {KEY}"}, 405),
    ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}, 401),
]


async def test_early_error_then_next_request_on_the_same_connection(core):
    body = json.dumps({"model": "x", "input": "hi"}).encode()
    async with live_server(core, api_key=KEY, max_body_bytes=MAX_BODY) as server:
        for method, path, headers, status in EARLY_ANSWERS:
            for _ in range(5):  # the race this guards against was lost about 8 times in 10
                first, second = await send_then_next(server.url, (head(method, path, body, **headers), body),
                                                     body_after_response=False)
                assert first is not None and first[0] == status
                assert second is not None and second[0] == 200, "a body right behind its headers keeps the connection"
                assert json.loads(second[2])["usage"]["completion_tokens"] == 2

        # The body held back until the answer is in: the server cannot wait for it, so it says
        # it will close, and does. (Each waits out the server's drain: all at once.)
        async def held_back(method, path, headers, status) -> None:
            first, second = await send_then_next(server.url, (head(method, path, body, **headers), body),
                                                 body_after_response=True)
            assert first[0] == status and first[1]["connection"] == "close"
            assert second is None

        async with trio.open_nursery() as nursery:
            for answer in EARLY_ANSWERS:
                nursery.start_soon(held_back, *answer)


async def test_body_over_the_limit_is_413_and_a_clean_close(core):
    body = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    async with live_server(core, api_key=KEY, max_body_bytes=MAX_BODY) as server:
        for body_after_response in (False, True):
            first, second = await send_then_next(
                server.url, (head("POST", "/v1/completions", body, Authorization=f"Bearer {KEY}"), body),
                body_after_response=body_after_response,
            )
            assert first[0] == 413 and first[1]["connection"] == "close"
            assert second is None


@asynccontextmanager
async def slow_link(url: str):
    """A loopback TCP relay in front of `url` that holds each request's body back 10 ms after its
    headers, as a real network between two writes does; yields the relay's URL."""

    async def pump(source: trio.SocketStream, sink: trio.SocketStream, split_after_headers: bool) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async for data in source:
                end_of_headers = data.find(b"\r\n\r\n") + 4 if split_after_headers else 0
                if 4 <= end_of_headers < len(data):
                    await sink.send_all(data[:end_of_headers])
                    await trio.sleep(0.01)
                    data = data[end_of_headers:]
                await sink.send_all(data)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await sink.send_eof()

    async def relay(client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream(*host_port(url)) as upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, upstream, True)
                nursery.start_soon(pump, upstream, client, False)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(functools.partial(trio.serve_tcp, relay, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def test_openai_sdk_warm_connection_404_then_chat(core):
    """The SDK's own connection pool: one warm connection, a 404 on it, then a chat call on it."""
    async with live_server(core) as server, slow_link(server.url) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=NEXT_ANSWER_TIMEOUT)
        async with client:  # no retries: a stall fails the test
            for _ in range(5):
                await client.models.list()
                with pytest.raises(openai.NotFoundError):
                    await client.post("/responses-nowhere", body={"model": server.model, "input": "hi"}, cast_to=object)
                chat = await client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert chat.usage.completion_tokens == 2


async def raw_exchange(url: str, data: bytes) -> bytes:
    """What the server sends back on a fresh connection that opens with `data`, until it closes
    the connection or a second passes."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.move_on_after(1):
            while chunk := await stream.receive_some():
                received += chunk
        return received


async def test_http2_is_refused_and_the_server_lives(server):
    """An HTTP/2 client with prior knowledge (as a gRPC health probe is) gets an HTTP/1.1 error,
    not an HTTP/2 session: Hypercorn's HTTP/2 path under trio could end the whole server from
    one connection (trillm/http/http1_only.py). An h2c upgrade is answered in HTTP/1.1."""
    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":path", "/grpc.health.v1.Health/Check"), (":scheme", "http"),
                            (":authority", "localhost"), ("content-type", "application/grpc")], end_stream=True)
    answer = await raw_exchange(server.url, client.data_to_send())
    assert answer.startswith(b"HTTP/1.1 4"), answer[:60]
    upgrade = await raw_exchange(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                                             b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
    assert upgrade.startswith(b"HTTP/1.1 200"), upgrade[:60]
    assert (await server.http().get("/health")).status_code == 200
