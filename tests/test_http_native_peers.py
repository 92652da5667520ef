"""The peers' native request shapes against a live server: LMDeploy's flat /generate and its
/abort_request (session_id, abort_message, finished_reason), LMDeploy's session_id on the OpenAI
routes, and SGLang's batch with a rid and sampling_params per prompt."""
import trio
from http_support import settled_stats

PROMPT = "The capital of France is"
LONG = {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}


async def abort_when_running(http, body: dict) -> dict:
    """Post an abort as soon as the request it names is live (404 until then)."""
    while True:
        response = await http.post("/abort_request", json=body)
        if response.status_code != 404:
            assert response.status_code == 200, response.text
            return response.json()
        await trio.sleep(0.02)


async def test_lmdeploy_flat_generate_matches_sglangs(server):
    http = server.http()
    flat = (await http.post("/generate", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "return_logprob": True, "session_id": 3})).json()
    nested = (await http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}})).json()
    assert flat["text"] == nested["text"] and flat["output_ids"] == nested["output_ids"]
    meta = flat["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert [t for _, t in meta["output_token_logprobs"]] == flat["output_ids"]
    ids = server.state.tokenizer.encode(PROMPT)
    by_ids = (await http.post("/generate", json={"input_ids": ids, "max_tokens": 6, "temperature": 0,
                                                 "top_k": 1})).json()
    assert by_ids["output_ids"] == flat["output_ids"]
    for body, param in (({"prompt": PROMPT, "image_data": "aGk="}, "image_data"),
                        ({"prompt": PROMPT, "return_routed_experts": True}, "return_routed_experts"),
                        ({"prompt": PROMPT, "sampling_params": {}}, "sampling_params"),  # one form or the other
                        ({"max_tokens": 4}, "prompt")):
        response = await http.post("/generate", json=body)
        assert response.status_code in (400, 422) and response.json()["error"]["param"] == param, body


async def test_lmdeploy_abort_by_session_id_reports_its_reason(server):
    http = server.http()
    results = {}

    async def run(key, body):
        results[key] = (await http.post("/generate", json=body)).json()

    for abort, expected in (({"abort_message": "user left"}, {"type": "abort", "message": "user left"}),
                            ({"finished_reason": {"type": "abort", "by": "router"}}, {"type": "abort", "by": "router"}),
                            ({}, {"type": "abort"})):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "flat", {"prompt": PROMPT, "session_id": 41, "max_tokens": 1000,
                                             "ignore_eos": True})
            assert (await abort_when_running(http, {"session_id": 41, **abort}))["num_aborted"] == 1
        assert results["flat"]["meta_info"]["finish_reason"] == expected
        assert results["flat"]["meta_info"]["completion_tokens"] < 1000
    missing = await http.post("/abort_request", json={"session_id": 41})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"
    assert (await settled_stats(http))["num_used_blocks"] == 0


async def test_session_id_names_openai_requests_for_abort(server):
    client = server.openai()
    finish = {}

    async def chat():
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Count to a thousand."}], max_tokens=1000,
            stream=True, extra_body={"session_id": 12, "ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish["reason"] = chunk.choices[0].finish_reason

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat)
        await abort_when_running(server.http(), {"session_id": 12})
    assert finish["reason"] == "abort"


async def test_sglang_batch_with_a_rid_and_settings_per_prompt(server):
    http = server.http()
    prompts = [PROMPT, "One, two, three,"]
    per_prompt = [{"max_new_tokens": 3, "ignore_eos": True, "temperature": 0},
                  {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}]
    batch = (await http.post("/generate", json={"text": prompts, "rid": ["r-a", "r-b"],
                                                "sampling_params": per_prompt})).json()
    assert [len(b["output_ids"]) for b in batch] == [3, 5]
    alone = (await http.post("/generate", json={"text": prompts[1], "sampling_params": per_prompt[1]})).json()
    assert batch[1]["output_ids"] == alone["output_ids"]

    results = {}

    async def run():
        results["batch"] = (await http.post("/generate", json={
            "text": prompts, "rid": ["long-a", "short-b"],
            "sampling_params": [LONG, {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}]})).json()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await abort_when_running(http, {"rid": "long-a"})
    long_a, short_b = results["batch"]
    assert long_a["meta_info"]["finish_reason"] == {"type": "abort"} and len(long_a["output_ids"]) < 1000
    assert short_b["meta_info"]["finish_reason"] == {"type": "length", "length": 40}, "only the named prompt ends"

    for body, param in (({"rid": ["x"]}, "rid"), ({"sampling_params": per_prompt[:1]}, "sampling_params"),
                        ({"sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params")):
        response = await http.post("/generate", json={"text": prompts, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, body
    assert (await settled_stats(http))["num_used_blocks"] == 0
