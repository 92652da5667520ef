"""Admin calls relayed to the other data-parallel replicas (`--data-parallel-peers`).

Behind the router (trillm/launch/data_parallel.py) a client sees one server, but each replica has
its own adapters, prefix cache, weights and running requests. The router forwards a route it
does not balance (`/v1/load_lora_adapter`, `/abort_request`, `/sleep`, ...) to one replica, so
that replica hands the call on to the others: an adapter loaded through the front door is
loaded everywhere (and /v1/models, answered by any one replica, lists it once), and an abort
reaches whichever replica holds the request.

A relayed call is the client's, as it came (method, path, query, body, its key), with
`RELAYED_HEADER` added: a replica that receives it acts on it alone and relays nothing, so a
call is never handed on twice. A client may send the header too; it then reaches only the
replica the router picked, which is all it could reach without the relay. The peers come from
the operator (the supervisor sets them for its replicas), never from a request.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import trio
from quart import request

from trillm.direct_http import open_direct
from trillm.http.errors import APIError
from trillm.http.settings import ServerSettings

RELAYED_HEADER = "X-Trillm-Relayed"
FORWARDED_HEADERS = ("Authorization", "x-api-key", "Content-Type")
# a relayed /sleep drains running requests and /update_weights loads a model: minutes, not seconds
RELAY_TIMEOUT = 600.0


@dataclass(frozen=True)
class PeerReply:
    """One peer's answer: its status (None when it could not be reached) and its body, or why not."""

    url: str
    status: int | None
    body: bytes

    @property
    def ok(self) -> bool:
        return self.status is not None and self.status < 400

    @property
    def error_status(self) -> int:
        """The status to answer with for this peer's failure: its own client error, else 503
        (unreachable, or failing: the front door is not at fault)."""
        return self.status if self.status is not None and 400 <= self.status < 500 else 503

    def json(self) -> dict:
        return json.loads(self.body)

    def reason(self) -> str:
        """What the peer said was wrong, in a sentence."""
        if self.status is None:
            return f"the replica at {self.url} could not be reached ({self.body.decode(errors='replace')})"
        try:
            message = self.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = self.body.decode(errors="replace")[:200]
        return f"the replica at {self.url} answered {self.status}: {message}"


def peers(settings: ServerSettings) -> list[str]:
    """The replicas this one relays to: none when the call came from one of them."""
    if not settings.data_parallel_peers or request.headers.get(RELAYED_HEADER):
        return []
    return ServerSettings.as_list(settings.data_parallel_peers)


async def relay(settings: ServerSettings) -> list[PeerReply]:
    """Send the current request to every peer at once and wait for all their replies ([] when
    it came from a peer, or there are none). The HTTP calls run in worker threads; cancelled
    with its caller, it returns at once and leaves them to finish alone."""
    urls = peers(settings)
    if not urls:
        return []
    body = await request.get_data()
    headers = {name: value for name in FORWARDED_HEADERS if (value := request.headers.get(name)) is not None}
    headers[RELAYED_HEADER] = "1"
    target = request.full_path if request.query_string else request.path
    replies: list[PeerReply] = []

    async def one(url: str) -> None:
        replies.append(await trio.to_thread.run_sync(_send, url, target, request.method, body, headers,
                                                     abandon_on_cancel=True))

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(one, url)
    return replies


async def relay_to_all(settings: ServerSettings) -> list[PeerReply]:
    """`relay`, for a call that must succeed on every replica (this one already has): the peers'
    replies, or an APIError, with the first refusing peer's status (`PeerReply.error_status`) and
    its words, when one did not. The replicas that succeeded keep the change; the error says so."""
    replies = await relay(settings)
    failed = [reply for reply in replies if not reply.ok]
    if failed:
        raise APIError(failed[0].error_status, f"This replica did it, but {failed[0].reason()}"
                               + (f" (and {len(failed) - 1} more refused)" if len(failed) > 1 else "") + ".")
    return replies


async def relay_count(settings: ServerSettings, field: str) -> int:
    """`relay`, for a call each replica answers with a count (`field`) or 404 for none: the sum
    of the peers' counts. An APIError if a peer failed otherwise, as `relay_to_all` says."""
    replies = await relay(settings)
    failed = [reply for reply in replies if not reply.ok and reply.status != 404]
    if failed:
        raise APIError(failed[0].error_status, f"Could not ask every replica: {failed[0].reason()}.")
    return sum(reply.json()[field] for reply in replies if reply.ok)


def _send(peer: str, target: str, method: str, body: bytes, headers: dict[str, str]) -> PeerReply:
    # no empty body: urllib would label it form-encoded, which the peer refuses (a 415)
    call = urllib.request.Request(peer + target, data=body or None, headers=headers, method=method)
    try:
        with open_direct(call, RELAY_TIMEOUT) as response:  # no proxy, no redirects
            return PeerReply(peer, response.status, response.read())
    except urllib.error.HTTPError as exc:
        return PeerReply(peer, exc.code, exc.read())
    except (urllib.error.URLError, OSError) as exc:
        return PeerReply(peer, None, str(getattr(exc, "reason", exc)).encode())
