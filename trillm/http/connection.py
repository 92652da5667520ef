"""The ASGI side of one HTTP request: every response ends its connection cleanly.

A keep-alive connection must, after each response, either answer the next request
or be closed. Two upstream behaviours together broke that when a response went out
before the request's body had arrived (an unknown route's 404, a 405, a 401, a 413:
answered from the headers alone) and the client sent the body in a second write,
as httpx, and so the `openai` SDK, does:

- Hypercorn (0.18, trio worker) can only recycle an HTTP/1.1 connection whose
  request body it has read to the end, so it closes the connection instead; and it
  runs that close, and the recycle too, inside the ASGI `send` call that ends the
  response, in the application's own task, after first telling the application
  `http.disconnect`.
- quart-trio cancels the request's nursery when it receives `http.disconnect`.

So the close was cancelled at its first checkpoint: the socket stayed open, Hypercorn
had already dropped the request's stream, and the next request on that connection
was read but never answered.

`Connection` works around both, here, without patching either library:

- a response that starts before the whole request body has arrived first waits,
  for at most `DRAIN_SECONDS`, for the rest of it (Quart reads and keeps it, up to
  `MAX_CONTENT_LENGTH`), so the connection can be reused; a body that is over that
  limit, or still not complete then, is not waited for: the response says
  `Connection: close`, and the client knows the connection ends with it;
- the `send` that ends the response runs shielded from cancellation, so whatever
  Hypercorn does inside it (recycle the connection, or close it) runs to the end.
"""
from __future__ import annotations

import trio
from quart_trio.asgi import TrioASGIHTTPConnection

DRAIN_SECONDS = 2.0  # a body sent right behind its headers arrives long before this


class Connection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, with the two rules of the module docstring."""

    async def __call__(self, receive, send) -> None:
        headers = dict(self.scope["headers"])
        body_done = trio.Event()
        if b"content-length" not in headers and b"transfer-encoding" not in headers:
            body_done.set()
        limit = self.app.config["MAX_CONTENT_LENGTH"]
        declared = headers.get(b"content-length", b"0")
        over_limit = limit is not None and declared.isdigit() and int(declared) > limit

        async def receive_noting_body_end():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done.set()
            return message

        async def send_ending_cleanly(message) -> None:
            if message["type"] == "http.response.start" and not body_done.is_set():
                if not over_limit:
                    with trio.move_on_after(DRAIN_SECONDS):
                        await body_done.wait()
                if not body_done.is_set():
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(receive_noting_body_end, send_ending_cleanly)
