"""Ollama's API, so the tools that speak it natively (its Python and JavaScript clients, editor
assistants, web UIs that list models with /api/tags) run against trillm unmodified:
POST /api/chat and /api/generate (NDJSON streams by default, one JSON object with
`"stream": false`), /api/embed and the older /api/embeddings, /api/show, GET /api/tags, /api/ps
and /api/version.

A chat or generate request is a chat generation underneath (trillm.http.protocol.ollama turns it
into a ChatCompletionRequest; `raw` generate tokenizes the prompt as it is): the same template,
tools, grammars, reasoning parser, admission, LoRA adapters by `model` (with or without Ollama's
`:latest` tag), prefix cache, metrics and abort; a client that leaves ends its stream and frees
its blocks before the next step. Each answer ends with Ollama's statistics: `prompt_eval_count`
(the prompt's tokens), `eval_count`, and durations in nanoseconds (total; prompt evaluation: until
the first token; evaluation: from it to the end). Tool calls come whole, their arguments an
object, in the chunk where the model finished writing them. Errors on these routes are Ollama's
`{"error": "..."}` (trillm.http.errors), mid-stream as a last NDJSON line.
"""
from __future__ import annotations

import datetime
import hashlib
import json

import pydantic
import trio
from quart import Blueprint, Response

import trillm
from trillm.engine.api import EngineUnavailableError, FinishReason
from trillm.http import openai_chat
from trillm.http.chat_output import ChatOutput, chat_output
from trillm.http.embeddings import check_dimensions, normalized, pooled_vectors, trimmed
from trillm.http.errors import APIError
from trillm.http.generation import Generation, capped, in_client_terms
from trillm.http.logprobs import chat_logprobs
from trillm.http.prompts import encode
from trillm.http.protocol.chat import ChatCompletionRequest
from trillm.http.protocol.ollama import (
    FIELD_NAMES, ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, Generating, ShowRequest,
)
from trillm.http.state import ServerState, current, parse_body, request_id, validated
from trillm.sampling_params import SamplingParamError

blueprint = Blueprint("ollama", __name__)
CHAT_FIELDS = {**FIELD_NAMES, "prompt": "messages"}
GENERATE_FIELDS = {**FIELD_NAMES, "messages": "prompt"}
DONE_REASONS = {FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}  # any other end is "stop"
NEVER = "2318-01-01T00:00:00Z"  # /api/ps's expiry of a model that stays loaded (Ollama's keep_alive -1)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _tagged(name: str) -> str:
    """A name as Ollama lists it: with its tag, `latest` when it has none."""
    return name if ":" in name else f"{name}:latest"


def _adapter(state: ServerState, model: str) -> str | None:
    """The LoRA adapter `model` names (None: the base model), with or without the `:latest` tag;
    a 400 without a name and a 404 for any other, in Ollama's words."""
    if not model:
        raise APIError(400, "model is required", "model")
    for name in (model, model.removesuffix(":latest")):
        if name == state.model_name:
            return None
        if name in state.engine.adapters:
            return name
    raise APIError(404, f"model '{model}' not found", "model")


def _loaded(req: Generating, body: dict) -> dict:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
    return {"model": req.model, "created_at": _now(), **body, "done": True, "done_reason": "load"}


async def _opening(body: type[pydantic.BaseModel]) -> tuple[float, ServerState, pydantic.BaseModel, str | None]:
    """When the request arrived, the server, the body as `body`, and the adapter it names."""
    started = trio.current_time()
    state = current()
    req = await parse_body(body)
    return started, state, req, _adapter(state, req.model)


@blueprint.post("/api/chat")
async def chat():
    started, state, req, lora = await _opening(ChatRequest)
    if not req.messages:
        return _loaded(req, {"message": {"role": "assistant", "content": ""}})
    with in_client_terms(CHAT_FIELDS):
        chat_req, params, choice, prompt = await state.off_loop(_prepare, state, req)
    output = chat_output(state.settings.reasoning_parser, state.tool_call_parser, choice, chat_req.parallel_tool_calls)
    return await _answer(state, req, Answer(state, req, output, started, chat=True), prompt, params, lora, CHAT_FIELDS)


@blueprint.post("/api/generate")
async def generate():
    started, state, req, lora = await _opening(GenerateRequest)
    req.check()
    if not req.prompt and not req.context:
        return _loaded(req, {"response": ""})
    with in_client_terms(GENERATE_FIELDS):
        _, params, choice, prompt = await state.off_loop(_prepare, state, req)
    output = chat_output(state.settings.reasoning_parser, None, choice, None)
    answer = Answer(state, req, output, started, chat=False, context=None if req.raw else prompt)
    return await _answer(state, req, answer, prompt, params, lora, GENERATE_FIELDS)


def _prepare(state: ServerState, req: ChatRequest | GenerateRequest) -> tuple:
    """The chat request, its sampling params, tool choice and prompt (off the event loop: the work
    grows with the messages): the template's, or generate's raw prompt as it is, after its
    `context`; `num_ctx` bounds prompt and answer together."""
    if req.think not in (None, False) and state.settings.reasoning_parser is None:
        raise SamplingParamError("think", f'"{req.model}" does not support thinking')
    chat_req = validated(ChatCompletionRequest, req.chat_body())
    if isinstance(req, GenerateRequest) and req.raw:
        params, choice = chat_req.to_sampling_params(state.vocab_size, state.tokenizer), "none"
        prompt = encode(state.tokenizer, req.prompt, "prompt", bound=state.prompt_bound)
    else:
        params, choice, prompt = openai_chat.prepare(state, chat_req)
    if isinstance(req, GenerateRequest) and req.context:
        prompt = _checked_context(state, req.context) + prompt
    return chat_req, _within_num_ctx(state, req, params, prompt), choice, prompt


def _checked_context(state: ServerState, context: list[int]) -> list[int]:
    if any(not 0 <= t < state.vocab_size for t in context):
        raise SamplingParamError("context", f"context holds a token id outside this model's vocabulary of "
                                            f"{state.vocab_size}.")
    return context


def _within_num_ctx(state: ServerState, req: Generating, params, prompt: list[int]):
    """The params with max_tokens capped where `num_ctx` ends (the answer's done_reason is then
    "length"); a num_ctx beyond the served context, or a prompt that fills it, is a 400."""
    num_ctx = req.num_ctx
    if num_ctx is None:
        return params
    if num_ctx > state.max_model_len:
        raise SamplingParamError("options.num_ctx", f"options.num_ctx is {num_ctx}, more than this model's context "
                                                    f"of {state.max_model_len} tokens.")
    room = num_ctx - len(prompt)
    if room <= 0:
        raise SamplingParamError("options.num_ctx", f"The prompt is {len(prompt)} tokens, which fills "
                                                    f"options.num_ctx of {num_ctx}.")
    return capped(params, room)


async def _answer(state: ServerState, req: Generating, answer: Answer, prompt: list[int], params, lora: str | None,
                  field_names: dict[str, str]):
    generation = Generation(state, *request_id("ollama"), [prompt], params, field_names=field_names, lora_name=lora)
    answer.generation = generation
    await generation.start()
    if req.stream:
        response = Response(_lines(generation, answer), content_type="application/x-ndjson")
        response.timeout = None  # as every stream: it lasts as long as its generation
        return response
    await generation.run(answer.feed)
    return answer.whole()


async def _lines(generation: Generation, answer: Answer):
    """Ollama's NDJSON: a line per chunk, the last one `done` with the statistics; an `error` line
    if the engine fails mid-stream."""
    try:
        async for _, delta in generation:
            for chunk in answer.feed(delta):
                yield _line(chunk)
        generation.close()
        yield _line(answer.final())
    except EngineUnavailableError as exc:
        yield _line({"error": str(exc)})
    finally:
        generation.close()


def _line(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


class Answer:
    """One answer's chunks, in chat's shape (`message`) or generate's (`response`), built from its
    choice's deltas; the whole answer and the closing statistics from what they carried."""

    def __init__(self, state: ServerState, req: Generating, output: ChatOutput, started: float, chat: bool,
                 context: list[int] | None = None):
        """`started`: when the request arrived (trio's clock); `context`: generate's prompt ids, which
        the last chunk returns with the answer's (Ollama's `context`), or None (chat, raw)."""
        self.state = state
        self.req = req
        self.output = output
        self.started = started
        self.chat = chat
        self.context = context
        self.generation: Generation | None = None
        self.first_token: float | None = None
        self.ended: float | None = None
        self.logprobs: list[dict] = []
        self._calls_sent = 0

    def feed(self, delta) -> list[dict]:
        """The chunk this delta makes, if any (text held back makes none)."""
        now = trio.current_time()
        if delta.token_ids and self.first_token is None:
            self.first_token = now
        parts = self.output.feed(delta.text)
        if delta.finished:
            parts = parts + self.output.finish()
            self.ended = now
        logprobs = None
        if delta.logprobs:
            logprobs = chat_logprobs(self.state.token_texts, delta.token_ids, delta.logprobs)["content"]
            self.logprobs += logprobs
        calls = self._finished_calls(delta.finished)
        if not (parts.content or parts.reasoning or calls or logprobs):
            return []
        chunk = {**self._head(), **self._body(parts.content, parts.reasoning, calls)}
        if logprobs:
            chunk["logprobs"] = logprobs
        chunk["done"] = False
        return [chunk]

    def _body(self, content: str, reasoning: str = "", calls: list[dict] | None = None) -> dict:
        """Chat's `message` or generate's `response` (and `thinking`, and the calls, where there are)."""
        body = {"content": content} if self.chat else {"response": content}
        if reasoning:
            body["thinking"] = reasoning
        if calls:
            body["tool_calls"] = calls
        return {"message": {"role": "assistant", **body}} if self.chat else body

    def _finished_calls(self, finished: bool) -> list[dict]:
        """Calls the model has finished writing and not yet sent: all but the last one it began,
        every one once its answer ended."""
        calls = self.output.tool_calls
        ready = len(calls) if finished else max(len(calls) - 1, 0)
        sent, self._calls_sent = self._calls_sent, max(self._calls_sent, ready)
        return [self._call(k) for k in range(sent, ready)]

    def _call(self, index: int) -> dict:
        call = self.output.tool_calls[index]
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:  # cut short by the length limit, or an integer longer than Python converts
            arguments = {}
        return {"id": call.id, "function": {"index": index, "name": call.name,
                                            "arguments": arguments if isinstance(arguments, dict) else {}}}

    def _head(self) -> dict:
        return {"model": self.req.model, "created_at": _now()}

    def _closing(self) -> dict:
        """`done`, the reason and the statistics."""
        completion = self.generation.choices[0].completion
        ended = self.ended if self.ended is not None else trio.current_time()
        first = self.first_token if self.first_token is not None else ended
        closing = {"done": True, "done_reason": DONE_REASONS.get(completion.finish_reason, "stop")}
        if self.context is not None:
            closing["context"] = self.context + completion.token_ids
        closing.update(total_duration=_nanoseconds(ended - self.started),
                       prompt_eval_count=len(self.generation.prompt(0)),
                       prompt_eval_duration=_nanoseconds(first - self.started),
                       eval_count=len(completion.token_ids), eval_duration=_nanoseconds(ended - first))
        return closing

    def final(self) -> dict:
        return {**self._head(), **self._body(""), **self._closing()}

    def whole(self) -> dict:
        output = self.output
        calls = [self._call(k) for k in range(len(output.tool_calls))]
        answer = {**self._head(), **self._body(output.content, output.reasoning, calls)}
        if self.req.logprobs:
            answer["logprobs"] = self.logprobs
        return {**answer, **self._closing()}


@blueprint.post("/api/embed")
async def embed():
    started, state, req, lora = await _opening(EmbedRequest)
    if req.options is not None:
        req.options.sampling()  # an option it does not run is refused here too
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts:
        return {"model": req.model, "embeddings": []}
    check_dimensions(state, req.dimensions)
    prompts = await state.off_loop(_embed_prompts, state, texts, req.truncate)
    _, vectors = await pooled_vectors(state, "embed", prompts, "input", lora)
    vectors = normalized(state, trimmed(vectors, req.dimensions))
    return {"model": req.model, "embeddings": [v.tolist() for v in vectors],
            "total_duration": _nanoseconds(trio.current_time() - started),
            "prompt_eval_count": sum(map(len, prompts))}


def _embed_prompts(state: ServerState, texts: list[str], truncate: bool) -> list[list[int]]:
    """Each text's tokens; with `truncate`, the first ones that fit the context (a long text cut
    before it is tokenized, well past where the context ends), else a 400 for a text too long.
    The engine takes a prompt shorter than the context, a pooling one too: one token short of it."""
    limit = state.max_model_len - 1
    prompts = []
    for k, text in enumerate(texts):
        param = "input" if len(texts) == 1 else f"input.{k}"
        if not text:
            raise SamplingParamError(param, "An input is empty.")
        if truncate:
            longest = state.prompt_bound.longest
            if longest:
                text = text[: 2 * longest * limit]
            prompts.append(encode(state.tokenizer, text, param)[:limit])
            continue
        prompt = encode(state.tokenizer, text, param, bound=state.prompt_bound)
        if len(prompt) > limit:
            raise SamplingParamError(param, f"The input is {len(prompt)} tokens, more than this model's context "
                                            f"holds ({limit}; send truncate: true to embed its start).")
        prompts.append(prompt)
    return prompts


@blueprint.post("/api/embeddings")
async def embeddings():
    """The older route: one prompt, its vector as the model pools it (not normalised), or [] for none."""
    _, state, req, lora = await _opening(EmbeddingsRequest)
    if not req.prompt:
        return {"embedding": []}
    prompt = await state.off_loop(lambda: encode(state.tokenizer, req.prompt, "prompt", bound=state.prompt_bound))
    _, (vector,) = await pooled_vectors(state, "embed", [prompt], "prompt", lora)
    return {"embedding": vector.tolist()}


def _listing(state: ServerState, facts, name: str, adapter=None) -> dict:
    details = facts.details()
    digest = facts.digest
    if adapter is not None:
        details["parent_model"] = _tagged(state.model_name)
        digest = hashlib.sha256(f"{facts.digest}:{adapter.name}".encode()).hexdigest()
    return {"name": _tagged(name), "model": _tagged(name), "modified_at": facts.modified_at, "size": facts.size,
            "digest": digest, "details": details}


def _served(state: ServerState):
    """(name, adapter or None) of everything `model` may name."""
    return [(state.model_name, None), *((a.name, a) for a in state.engine.adapters.values())]


@blueprint.get("/api/tags")
async def tags():
    state = current()
    facts = await state.model_facts()
    return {"models": [_listing(state, facts, name, adapter) for name, adapter in _served(state)]}


@blueprint.get("/api/ps")
async def ps():
    """The served model and its adapters, always loaded; `size_vram` is the file's size on a GPU."""
    state = current()
    facts = await state.model_facts()
    on_gpu = state.engine.config.device.type == "cuda"
    return {"models": [{**_listing(state, facts, name, adapter), "expires_at": NEVER,
                        "size_vram": facts.size if on_gpu else 0, "context_length": state.max_model_len}
                       for name, adapter in _served(state)]}


@blueprint.post("/api/show")
async def show():
    state = current()
    req = await parse_body(ShowRequest)
    _adapter(state, req.model or req.name or "")
    facts = await state.model_facts()
    info = dict(facts.info)
    if req.verbose:
        info.update(facts.long_lists)
    capabilities = ["completion"]
    if state.tool_call_parser is not None:
        capabilities.append("tools")
    if state.settings.reasoning_parser is not None:
        capabilities.append("thinking")
    return {"license": "", "parameters": _parameters(state), "template": state.chat_template or "",
            "details": facts.details(), "model_info": info, "capabilities": capabilities,
            "modified_at": facts.modified_at}


def _parameters(state: ServerState) -> str:
    """The Modelfile's parameter lines a client reads: the context, and the stop tokens."""
    lines = [f"num_ctx {state.max_model_len}"]
    tokenizer = state.tokenizer
    if tokenizer is not None:
        for token_id in state.engine.config.eos_token_ids:
            lines.append(f"stop {json.dumps(tokenizer.convert_ids_to_tokens(token_id))}")
    return "\n".join(lines)


@blueprint.get("/api/version")
async def version():
    return {"version": trillm.__version__}

