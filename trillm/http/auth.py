"""`--api-key`: a Bearer token on every route that does work, changes state or tells more
than liveness.

Open without the key: what probes, scrapers and schema readers call (`OPEN_PATHS`), and
every CORS preflight (`OPTIONS`), which browsers send without credentials. Everything
else, `/v1/*` and the native `/generate`, `/abort_request`, `/flush_cache`, `/tokenize`,
`/detokenize`, `/server_info`, ... (and any route added later), needs the key: the list
is of what stays open, so a new route is guarded unless someone decides otherwise. The
comparison is constant-time, so response timing does not leak how much of a guessed key
was right.
"""
from __future__ import annotations

import hmac

from quart import Response, request

from trillm.http.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json"})


def check_api_key(api_key: str) -> Response | None:
    """A 401 response when the request needs the key and lacks it; None to let it through."""
    if request.method == "OPTIONS" or request.path in OPEN_PATHS:
        return None
    given = request.headers.get("Authorization", "").encode()
    if hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        return None
    return error_response(401, "Missing or incorrect API key: send the header 'Authorization: Bearer <key>'.")
