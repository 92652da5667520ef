"""CORS, as a browser front end meets it: a preflight, then the cross-origin request, with vLLM's
flags (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials) and defaults."""
import pytest

from http_support import live_server, tiny_core
from trillm.http.settings import ServerSettings

KEY = "sesame-0123456789"
APP = "https://chat.example"


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


def preflight_headers(origin: str, method: str = "POST") -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization,content-type"}


async def test_by_default_any_origin_may_call_and_the_preflight_needs_no_key(core):
    async with live_server(core, api_key=KEY) as server:
        http = server.http()
        preflight = await http.options("/v1/chat/completions", headers=preflight_headers(APP))
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"] or \
            preflight.headers["access-control-allow-methods"] == "*"
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        call = await http.post("/v1/chat/completions", json=body,
                               headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "*"
        refused = await http.post("/v1/chat/completions", json=body, headers={"Origin": APP})
        # A browser can read the 401 only with the CORS header on it too.
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-origin" not in (await http.get("/health")).headers  # no Origin: no CORS


async def test_named_origins_methods_headers_and_credentials(core):
    settings = dict(allowed_origins=f'["{APP}"]', allowed_methods="GET,POST", allowed_headers="content-type",
                    allow_credentials=True)
    async with live_server(core, **settings) as server:
        http = server.http()
        preflight = await http.options("/v1/completions", headers=preflight_headers(APP))
        assert preflight.headers["access-control-allow-origin"] == APP
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert preflight.headers["access-control-allow-headers"].lower() == "content-type"
        assert set(preflight.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
        assert "origin" in preflight.headers["vary"].lower()
        other = await http.options("/v1/completions", headers=preflight_headers("https://evil.example"))
        assert "access-control-allow-origin" not in other.headers
        call = await http.post("/v1/completions", json={"model": server.model, "prompt": [5, 6], "max_tokens": 1},
                               headers={"Origin": APP})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == APP
        stream = await http.post("/v1/completions", headers={"Origin": APP}, json={
            "model": server.model, "prompt": [5, 6], "max_tokens": 2, "stream": True})
        assert stream.headers["access-control-allow-origin"] == APP and stream.text.endswith("data: [DONE]\n\n")


def test_credentials_with_a_wildcard_origin_are_refused_at_start(core):
    from trillm.http.app import create_app

    with pytest.raises(ValueError, match="allow-credentials"):
        create_app(ServerSettings(allow_credentials=True), core)
    assert ServerSettings.as_list('["a", "b"]') == ["a", "b"] and ServerSettings.as_list(" a, b ,") == ["a", "b"]
