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
the weights or abort everyone's requests of a server that has no key to guard them. A page
can name itself the server's own site by DNS rebinding (its host name made to resolve to the
server's address: then its `Origin` and the `Host` its browser sends agree), so the `Host`
itself must be one the server answers to: a loopback name or address, the address it was
bound to, or one of `--allowed-hosts`. A front end of another origin that should reach them
is named in `--admin-origins`; its preflights are the only ones an admin route answers.
"""
from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from quart import Response, request

from trillm.http.errors import APIError, error_response

# /get_load: vllm-router polls it without the key (its api_key reaches no call of its own); it
# tells what /metrics already does. /api/version is Ollama's /version. The chat page's files hold
# no data (the page asks for the key before it calls anything else).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/api/version", "/metrics", "/get_load", "/openapi.json",
                        "/"})
OPEN_PREFIXES = ("/ui/",)
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/sleep", "/wake_up", "/wakeup", "/flush_cache", "/reset_prefix_cache", "/abort_request",
})


def check_api_key(api_key: str) -> Response | None:
    """A 401 response when the request needs the key and lacks it; None to let it through."""
    if request.method == "OPTIONS" or request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
        return None
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # an auth scheme's name is case-insensitive (RFC 9110 11.1): bearer and BEARER are Bearer
    bearer = token.strip().encode() if scheme.lower() == "bearer" else b""
    header = request.headers.get("x-api-key", "").encode()
    # both compared, whichever is sent, so the time taken does not tell which header was right
    if hmac.compare_digest(bearer, api_key.encode()) | hmac.compare_digest(header, api_key.encode()):
        return None
    return error_response(401, "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                               "or 'x-api-key: <key>'.")


class AdminAccess:
    """Who may call the admin routes of a server without a key: by `Host`, the loopback names
    and addresses, the bound address (`host`, unless a wildcard) and `allowed_hosts`; by
    `Origin` (a browser's), the server's own and `admin_origins`."""

    def __init__(self, host: str, allowed_hosts: list[str], admin_origins: list[str]):
        self.hosts = frozenset(h.strip("[]").lower() for h in [*allowed_hosts, host] if h not in ("", "0.0.0.0", "::"))
        self.origins = frozenset(o.rstrip("/").lower() for o in admin_origins)

    def host_allowed(self, host: str | None) -> bool:
        if host is None:
            return True  # HTTP/1.0 without one: not a browser, which always sends it
        name = urlsplit(f"//{host}").hostname
        if name is None:
            return False
        if name in self.hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def check(self) -> None:
        """A 403 for an admin route (`ADMIN_PATHS`) called with a `Host` this server does not
        answer to, or by a browser from another site: its request names an `Origin` other than
        this server's own and `admin_origins`, or says `Sec-Fetch-Site` cross-site or same-site;
        a preflight from any origin but `admin_origins`. For a server without --api-key; with
        one, the key is what guards them."""
        if request.path not in ADMIN_PATHS:
            return
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            raise APIError(403, f"{request.path} answers only requests addressed to this server by a loopback "
                                "name, its bound address or a name in --allowed-hosts: start it with "
                                "--allowed-hosts naming the host, or with --api-key and send the key.")
        origin = request.headers.get("Origin")
        listed = origin is not None and origin.rstrip("/").lower() in self.origins
        if request.method == "OPTIONS":
            if not listed:
                raise APIError(403, f"{request.path} is not open to web pages of other origins than "
                                    "--admin-origins names.")
            return
        own = origin is not None and urlsplit(origin).netloc == host
        site = request.headers.get("Sec-Fetch-Site")
        if not listed and ((origin is not None and not own) or site in ("cross-site", "same-site")):
            raise APIError(403, f"{request.path} is not open to web pages of other sites: call it from outside a "
                                "browser, name the page's origin in --admin-origins, or start the server with "
                                "--api-key and send the key.")
