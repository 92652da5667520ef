"""--api-key: every /v1/* route, whatever its method, refuses a missing or wrong key with a 401;
the operational routes (/health, /metrics, ...) stay open; /server_info never shows the key."""
import re

import pytest
from http_support import live_server, tiny_core

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


async def test_api_key_guards_every_v1_route_and_nothing_else(core):
    async with live_server(core, api_key=KEY) as server:
        http = server.http()
        guarded = [(m, p) for m, p in routes(server.app) if p.startswith("/v1/")]
        assert len(guarded) >= 4  # models, model, chat, completions
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = await http.request(method, path, json={}, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
            allowed = await http.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}"})
            assert allowed.status_code != 401, (method, path)
        for path in ("/health", "/metrics", "/version", "/openapi.json", "/server_info"):
            assert (await http.get(path)).status_code == 200, path
        info = (await http.get("/server_info")).text
        assert KEY not in info and "<redacted>" in info
        ok = await server.openai(api_key=KEY).completions.create(model=server.model, prompt=[5, 6], max_tokens=2)
        assert ok.usage.completion_tokens == 2
