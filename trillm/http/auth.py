"""`--api-key`: a Bearer token on /v1/* (the OpenAI surface), as vLLM does.

Health, metrics and the native endpoints stay open: probes and scrapers carry no
token. The comparison is constant-time, so response timing does not leak how
much of a guessed key was right.
"""
from __future__ import annotations

import hmac

from quart import Response, request

from trillm.http.errors import error_response


def check_api_key(api_key: str) -> Response | None:
    """A 401 response when the request needs the key and lacks it; None to let it through."""
    if request.method == "OPTIONS" or not request.path.startswith("/v1/"):
        return None
    given = request.headers.get("Authorization", "").encode()
    if hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        return None
    return error_response(401, "Missing or incorrect API key: send the header 'Authorization: Bearer <key>'.")
