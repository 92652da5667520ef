"""--api-key: every route, whatever its method, refuses a missing or wrong key with a 401 (in its
API's error shape), but the liveness and schema routes (/health, /ping, /version, /metrics,
/openapi.json) and the chat page's files, which stay open, and CORS preflights; /server_info
never shows the key."""
import re

import pytest
from http_support import live_server, tiny_core

from trillm.http.auth import OPEN_PATHS, OPEN_PREFIXES

KEY = "sesame-0123456789"


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


def routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route of the app, path arguments filled in."""
    found = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<[^>]+>", "some-model", rule.rule)
        found += [(method, path) for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return found


async def test_api_key_guards_every_route_but_liveness_and_schema(core):
    async with live_server(core, api_key=KEY) as server:
        http = server.http()
        guarded = [(m, p) for m, p in routes(server.app) if p not in OPEN_PATHS and not p.startswith(OPEN_PREFIXES)]
        guarded_paths = {p for _, p in guarded}
        # what generates, aborts, flushes or tells more than liveness
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/abort_request",
                "/flush_cache", "/tokenize", "/detokenize", "/server_info", "/model_info", "/load"} <= guarded_paths
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = await http.request(method, path, json={}, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                if path.startswith("/api/"):  # Ollama's shape: the message alone
                    assert "API key" in error, path
                else:
                    assert error["type"] == "authentication_error"
            for scheme in ("Bearer", "bearer", "BEARER"):  # a scheme's name is case-insensitive (RFC 9110)
                allowed = await http.request(method, path, json={}, headers={"Authorization": f"{scheme} {KEY}"})
                assert allowed.status_code != 401, (method, path, scheme)
            preflight = await http.options(path, headers={"Origin": "http://example.com",
                                                          "Access-Control-Request-Method": method})
            assert preflight.status_code != 401, ("OPTIONS", path)
        assert OPEN_PATHS <= {p for _, p in routes(server.app)}
        for path in [*OPEN_PATHS, "/ui/app.js"]:
            assert (await http.get(path)).status_code == 200, path
        assert (await http.post("/abort_request", json={"abort_all": True})).status_code == 401
        info = (await http.get("/server_info", headers={"Authorization": f"Bearer {KEY}"})).text
        assert KEY not in info and "<redacted>" in info
        ok = await server.openai(api_key=KEY).completions.create(model=server.model, prompt=[5, 6], max_tokens=2)
        assert ok.usage.completion_tokens == 2
