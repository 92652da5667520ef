"""POST /v1/chat/completions, streamed or not, in OpenAI's shapes (vLLM's where OpenAI has none:
finish_reason "abort", `stop_reason`)."""
from __future__ import annotations

import time

from quart import Blueprint

from trillm.engine.output import Delta
from trillm.http.generation import Generation
from trillm.http.logprobs import TokenTexts, chat_logprobs
from trillm.http.prompts import chat_prompt
from trillm.http.protocol import ChatCompletionRequest
from trillm.http.sse import stream_response
from trillm.http.state import current, parse_body, request_id
from trillm.sampling_params import SamplingParamError

blueprint = Blueprint("openai_chat", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions():
    state = current()
    req = await parse_body(ChatCompletionRequest)
    state.check_model(req.model)
    params = req.to_sampling_params(state.vocab_size)
    prompt = chat_prompt(state.tokenizer, req.messages, req.chat_template_kwargs)
    generation = Generation(state, request_id("chatcmpl"), [prompt], params)
    try:
        await generation.start()
    except SamplingParamError as exc:
        # The engine speaks of "prompt"; this client sent messages.
        raise SamplingParamError("messages" if exc.param == "prompt" else exc.param, str(exc)) from None
    chunks = ChatChunks(generation, req, state.model_name, state.token_texts)
    if req.stream:
        return stream_response(generation, chunks)
    await generation.run()
    return chunks.response()


class ChatChunks:
    def __init__(self, generation: Generation, req: ChatCompletionRequest, model: str, texts: TokenTexts):
        self.generation = generation
        self.req = req
        self.texts = texts
        self.head = {"id": generation.request_id, "created": int(time.time()), "model": model}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self.head, "object": "chat.completion.chunk", "choices": choices}
        if self.req.continuous_usage:
            chunk["usage"] = self.generation.usage()
        elif self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict]:
        return [
            self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
            for i in range(self.generation.num_choices)
        ]

    def chunk(self, index: int, delta: Delta) -> dict | None:
        if not (delta.text or delta.logprobs or delta.finished):
            return None  # text held back (half a character, a possible stop string)
        choice = {
            "index": index,
            "delta": {"content": delta.text},
            "logprobs": None if delta.logprobs is None else chat_logprobs(self.texts, delta.token_ids, delta.logprobs),
            "finish_reason": delta.finish_reason,
        }
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        return self._chunk([choice])

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [{**self.head, "object": "chat.completion.chunk", "choices": [], "usage": self.generation.usage()}]

    def response(self) -> dict:
        choices = []
        for i, processor in enumerate(self.generation.processors):
            c = processor.completion
            choices.append({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(self.texts, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": self.generation.usage()}
