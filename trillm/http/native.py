"""The native endpoints, in the shapes SGLang-style servers use: /generate (LMDeploy's flat
body too), /abort_request, /tokenize, /detokenize, /flush_cache (vLLM's /reset_prefix_cache);
and vLLM's /tokenizer_info, which lets clients such as lm-evaluation-harness tokenize through
the server instead of loading the tokenizer themselves.

Schema errors here are 422, as the FastAPI servers these endpoints come from answer;
a value out of range is still 400. Both use the OpenAI error body.

/generate streams SGLang's way: every event holds the text and ids so far (not a
delta), and `meta_info.finish_reason` is null until the last one.
"""
from __future__ import annotations

import json

from quart import Blueprint, Response

from trillm.engine.api import Delta, FinishReason
from trillm.http import peer_relay
from trillm.http.errors import APIError
from trillm.http.generation import Generation
from trillm.http.logprobs import reported_prompt_tokens
from trillm.http.prompts import chat_prompt, completion_prompts, encode, require_tokenizer
from trillm.http.protocol.native import AbortRequest, DetokenizeRequest, GenerateRequest, LMDeployGenerateRequest, TokenizeRequest
from trillm.http.sse import stream_response
from trillm.http.state import current, parse_body, read_json, request_id, validate
from trillm.sampling_params import SamplingParamError

blueprint = Blueprint("native", __name__)


# What only LMDeploy's flat body has: a body with any of these is read as LMDeploy's.
LMDEPLOY_ONLY = frozenset(LMDeployGenerateRequest.model_fields) - frozenset(GenerateRequest.model_fields)


@blueprint.post("/generate")
async def generate():
    """SGLang's body, or LMDeploy's flat one (told apart by LMDeploy's own fields)."""
    state = current()
    body = await read_json()
    if isinstance(body, dict) and LMDEPLOY_ONLY & body.keys():
        req = (await validate(LMDeployGenerateRequest, body, status=422)).to_native()
        text_field, field_names = "prompt", None
    else:
        req = await validate(GenerateRequest, body, status=422)
        text_field, field_names = "text", {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, f"Send exactly one of {text_field} and input_ids.", text_field)
    prompt = req.text if req.text is not None else req.input_ids
    prompts = await state.off_loop(completion_prompts, state.tokenizer, prompt)
    params = req.to_sampling_params(len(prompts))
    lora_name = await req_lora(state, req, len(prompts))
    if isinstance(req.rid, list):  # each prompt named by the client: the server's id names the batch
        server_id, _ = request_id("gen")
        generation = Generation(state, server_id, req.rid, prompts, params, field_names=field_names,
                                lora_name=lora_name)
    else:
        generation = Generation(state, *request_id("gen", req.rid), prompts, params, field_names=field_names,
                                lora_name=lora_name)
    await generation.start()
    batched = isinstance(req.text, list) or (req.input_ids is not None and isinstance(req.input_ids[0], list))
    chunks = GenerateChunks(generation)
    if req.stream:
        return stream_response(generation, chunks)
    await generation.run()
    results = [chunks.result(i) for i in range(generation.num_choices)]
    return results if batched or generation.n > 1 else results[0]


class GenerateChunks:
    def __init__(self, generation: Generation):
        self.generation = generation

    def result(self, index: int) -> dict:
        c = self.generation.choices[index].completion
        meta = {
            "id": self.generation.request_id,
            "finish_reason": _finish_reason(c.finish_reason, c.stop_reason, len(c.token_ids),
                                            self.generation.abort_note),
            "prompt_tokens": len(self.generation.prompt(index)),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.num_cached_tokens,
        }
        if c.logprobs is not None:
            meta["output_token_logprobs"] = [[lp.logprob, t] for t, lp in zip(c.token_ids, c.logprobs)]
            meta["output_top_logprobs"] = [[[v, t] for t, v in lp.top] for lp in c.logprobs]
        if c.prompt_logprobs is not None:  # from logprob_start_len on; position 0's logprob is null
            ids = reported_prompt_tokens(self.generation.prompt(index), c.prompt_logprobs)
            meta["input_token_logprobs"] = [[lp and lp.logprob, t] for t, lp in zip(ids, c.prompt_logprobs)]
            meta["input_top_logprobs"] = [lp and [[v, t] for t, v in lp.top] for lp in c.prompt_logprobs]
        return {"index": index, "text": c.text, "output_ids": c.token_ids, "meta_info": meta}

    def opening(self) -> list[dict]:
        return []

    def chunk(self, index: int, delta: Delta) -> dict | None:
        return self.result(index)

    def closing(self) -> list[dict]:
        return []


def _finish_reason(reason: FinishReason | None, stop_reason: str | int | None, num_tokens: int,
                   abort_note: dict | None) -> dict | None:
    """SGLang's finish_reason object; an aborted request's is what its abort said, if anything."""
    if reason is None:
        return None
    if reason == FinishReason.ABORT and abort_note is not None:
        return abort_note
    if reason == FinishReason.STOP:
        return {"type": reason, "matched": stop_reason}
    if reason == FinishReason.LENGTH:
        return {"type": reason, "length": num_tokens}
    return {"type": reason}


@blueprint.post("/abort_request")
async def abort_request():
    """`{"rid": id}` aborts the request whose response `id` that is, or else every live request
    whose client named it so (the native `rid`, LMDeploy's `session_id`, or an X-Request-Id
    header), all their samples (of a batch whose prompts have their own rids, that prompt's);
    `{"abort_all": true}` aborts every one. Their streams end with finish_reason "abort" (on
    /generate, `finished_reason` or `abort_message` when the abort gave one); their blocks are
    free before the next step. Behind the data-parallel router, on every replica."""
    state = current()
    engine = state.engine
    req = await parse_body(AbortRequest, status=422)
    if req.abort_all:
        return {"num_aborted": await engine.abort_everywhere(None, note=req.note)
                + await peer_relay.relay_count(state.settings, "num_aborted")}
    if req.name is None:
        raise APIError(400, "Send a rid or session_id, or abort_all: true.", "rid")
    param = "rid" if req.rid is not None else "session_id"
    num_aborted = await engine.abort_everywhere(req.name, note=req.note)
    num_aborted += await peer_relay.relay_count(state.settings, "num_aborted")
    if not num_aborted:
        raise APIError(404, f"No running request has {param} {req.name!r}.", param)
    return {"num_aborted": num_aborted}


@blueprint.post("/tokenize")
async def tokenize():
    state = current()
    req = await parse_body(TokenizeRequest, status=422)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "Send exactly one of prompt and messages.", "prompt")
    # serialised in the thread too: a long prompt's ids are megabytes of JSON
    return Response(await state.off_loop(_tokenized, state, req), content_type="application/json")


def _tokenized(state, req: TokenizeRequest) -> str:
    if req.messages is not None:
        tokens = chat_prompt(state.tokenizer, req.messages, req.template_options(), tools=req.tools)
    else:
        tokens = encode(state.tokenizer, req.prompt, "prompt", req.add_special_tokens is not False)
    body = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
    return json.dumps(body)


@blueprint.post("/detokenize")
async def detokenize():
    state = current()
    req = await parse_body(DetokenizeRequest, status=422)
    require_tokenizer(state.tokenizer, "tokens")
    bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"Token ids must be in [0, {state.vocab_size}); got {bad[0]}.", "tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, req.tokens)}


@blueprint.get("/tokenizer_info")
async def tokenizer_info():
    state = current()
    tokenizer = state.tokenizer
    require_tokenizer(tokenizer, "model")
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": state.max_model_len,
    }


@blueprint.post("/flush_cache")
@blueprint.post("/reset_prefix_cache")  # vLLM's name
async def flush_cache():
    """Empty the prefix cache (behind the data-parallel router, every replica's). Refused while
    requests run: their blocks are in use."""
    state = current()
    if not await state.engine.reset_prefix_cache():
        raise APIError(400, "Cannot flush the prefix cache while requests are running; retry when idle.")
    await peer_relay.relay_to_all(state.settings)
    return {"message": "The prefix cache is empty."}


async def req_lora(state, req, num_prompts: int) -> str | list[str | None] | None:
    """SGLang's `lora_path`: a loaded adapter's name for the batch, or one (or null) per prompt."""
    if not isinstance(req.lora_path, list):
        return await state.requested_lora(req.lora_path, field="lora_path")
    if len(req.lora_path) != num_prompts:
        raise SamplingParamError("lora_path", f"lora_path lists {len(req.lora_path)} entries for {num_prompts} prompts.")
    return [await state.requested_lora(name, field="lora_path") for name in req.lora_path]
