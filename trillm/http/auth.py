"""`--api-key`: a Bearer token (or, as Anthropic's SDKs send it, an `x-api-key` header) on every
route that does work, changes state or tells more than liveness.

Open without the key: what probes, scrapers, routers and schema readers call (`OPEN_PATHS`), and
every CORS preflight (`OPTIONS`), which browsers send without credentials. Everything
else, `/v1/*` and the native `/generate`, `/abort_request`, `/flush_cache`, `/tokenize`,
`/detokenize`, `/server_info`, ... (and any route added later), needs the key: the list
is of what stays open, so a new route is guarded unless someone decides otherwise. The
comparison is constant-time, so response timing does not leak how much of a guessed key
was right.

Without a key, the routes that change the server rather than ask it for tokens
(`ADMIN_PATHS`: weights, adapters, sleep, the prefix cache, aborts) refuse any request a
browser sent from another site (`check_admin_origin`): CORS lets every origin call the
generation routes, as vLLM's defaults do, but no web page a user happens to visit may swap
the weights or abort everyone's requests of a server that has no key to guard them.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from quart import Response, request

from trillm.http.errors import APIError, error_response

# /get_load: vllm-router polls it without the key (its api_key reaches no call of its own); it
# tells what /metrics already does
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/get_load", "/openapi.json"})
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/sleep", "/wake_up", "/wakeup", "/flush_cache", "/reset_prefix_cache", "/abort_request",
})


def check_api_key(api_key: str) -> Response | None:
    """A 401 response when the request needs the key and lacks it; None to let it through."""
    if request.method == "OPTIONS" or request.path in OPEN_PATHS:
        return None
    bearer = request.headers.get("Authorization", "").encode()
    header = request.headers.get("x-api-key", "").encode()
    # both compared, whichever is sent, so the time taken does not tell which header was right
    if hmac.compare_digest(bearer, f"Bearer {api_key}".encode()) | hmac.compare_digest(header, api_key.encode()):
        return None
    return error_response(401, "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                               "or 'x-api-key: <key>'.")


def check_admin_origin() -> None:
    """A 403 for an admin route (`ADMIN_PATHS`) called by a browser from another site: its
    request names an `Origin` other than this server's own, or says `Sec-Fetch-Site` cross-site
    or same-site. For a server without --api-key; with one, the key is what guards them."""
    if request.path not in ADMIN_PATHS or request.method == "OPTIONS":
        return
    origin = request.headers.get("Origin")
    own = origin is not None and urlsplit(origin).netloc == request.headers.get("Host")
    site = request.headers.get("Sec-Fetch-Site")
    if (origin is not None and not own) or site in ("cross-site", "same-site"):
        raise APIError(403, f"{request.path} is not open to web pages of other sites: call it from outside a "
                            "browser, or start the server with --api-key and send the key.")
