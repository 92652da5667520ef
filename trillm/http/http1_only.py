"""HTTP/1.1 only: Hypercorn is kept from switching a connection to HTTP/2.

Why: under the trio worker, Hypercorn 0.18's HTTP/2 path can close a connection (send_eof,
outside its send lock) while its send task is still writing to it; the write raises
trio.BusyResourceError out of the connection's handler, and the handler's error ends the
whole server. One client is enough: sglang-router's gRPC health probe, which speaks HTTP/2
with prior knowledge, takes a replica down on its first check. No client of an OpenAI server
needs HTTP/2 (the peers' servers speak HTTP/1.1 only), so the switch is refused instead:

- a connection that opens with the HTTP/2 preface (`PRI * HTTP/2.0`) is read as HTTP/1.1,
  so it gets an HTTP/1.1 error and is closed, as from a server that never spoke HTTP/2;
- an `Upgrade: h2c` request is answered in HTTP/1.1, as RFC 9113 lets a server do.

`install()` puts the HTTP/1.1 protocol that never switches where Hypercorn's connection
wrapper looks it up for each new connection; it is idempotent.
"""
from __future__ import annotations

import hypercorn.protocol
from hypercorn.protocol.h11 import H11Protocol


class HTTP11Only(H11Protocol):
    async def _check_protocol(self, event) -> None:
        """Never switch protocols (Hypercorn's checks the request for an h2c upgrade or the
        HTTP/2 preface here); the request goes on as HTTP/1.1."""


def install() -> None:
    hypercorn.protocol.H11Protocol = HTTP11Only
