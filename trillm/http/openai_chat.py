"""POST /v1/chat/completions, streamed or not, in OpenAI's shapes (vLLM's where OpenAI has none:
finish_reason "abort", `stop_reason`, `reasoning_content`). Tool calls and reasoning are split
out of each choice's text by trillm.http.chat_output."""
from __future__ import annotations

import logging
import time

from quart import Blueprint

from trillm.engine.api import Delta
from trillm.http.chat_output import chat_output
from trillm.http.generation import Generation
from trillm.http.logprobs import TokenTexts, chat_logprobs, vllm_prompt_logprobs
from trillm.http.logs import clipped
from trillm.http.prompts import NO_BOUND, chat_prompt, encode
from trillm.http.protocol.chat import ChatCompletionRequest
from trillm.http.sse import UsageChunks, stream_response
from trillm.http.state import ServerState, model_request, request_id
from trillm.http.tools import tool_choice

log = logging.getLogger(__name__)
blueprint = Blueprint("openai_chat", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions():
    state, req = await model_request(ChatCompletionRequest)
    params, choice, prompt = await state.off_loop(prepare, state, req)
    generation = Generation(state, *request_id("chatcmpl", req.session_name), [prompt], params,
                            field_names=req.field_names, lora_name=await state.requested_lora(req.model, req.lora_request))
    if req.user is not None or req.metadata:
        log.info("%s user=%s metadata=%s", generation.request_id, clipped(req.user), clipped(req.metadata or {}))
    await generation.start()
    chunks = ChatChunks(generation, req, state, choice)
    if req.stream:
        return stream_response(generation, chunks)
    await generation.run()
    return chunks.response()


def prepare(state: ServerState, req: ChatCompletionRequest) -> tuple:
    """The sampling params, the tool choice and the prompt's token ids (off the event loop: the
    template and the tokenizer work in proportion to the request; Ollama's chat runs it too)."""
    params = req.to_sampling_params(state.vocab_size, state.tokenizer)
    choice, params = tool_choice(req, state.tool_call_parser, params)
    tools = req.tools if choice != "none" else None
    raw = req.raw_prompt()
    bound = state.prompt_bound if req.truncate_prompt_tokens is None else NO_BOUND  # truncated: any length
    if raw is not None:
        prompt = encode(state.tokenizer, raw, "messages", bound=bound)
    else:
        options = req.template_options(state.chat_template, state.settings.trust_request_chat_template)
        prompt = chat_prompt(state.tokenizer, req.messages, options, tools=tools, bound=bound,
                             templates=state.request_templates)
    return params, choice, req.truncated(prompt, state.max_model_len)


class ChatChunks(UsageChunks):
    def __init__(self, generation: Generation, req: ChatCompletionRequest, state: ServerState, choice):
        self.head = {"id": generation.request_id, "created": int(time.time()), "model": req.model or state.model_name}
        super().__init__(generation, req, {**self.head, "object": "chat.completion.chunk"})
        self.texts: TokenTexts = state.token_texts
        self.return_token_ids = req.return_token_ids  # vLLM's: prompt_token_ids, and each choice's token_ids
        reasoning = state.settings.reasoning_parser if req.separate_reasoning else None
        self.outputs = [
            chat_output(reasoning, state.tool_call_parser, choice, req.parallel_tool_calls, req.stream_reasoning,
                        req.include_reasoning)
            for _ in range(generation.num_choices)
        ]

    def opening(self) -> list[dict]:
        chunks = [
            self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
            for i in range(self.generation.num_choices)
        ]
        if self.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.generation.prompt(0)
        return chunks

    def chunk(self, index: int, delta: Delta) -> dict | None:
        output = self.outputs[index]
        parts = output.feed(delta.text)
        if delta.finished:
            parts += output.finish()
        ids = self.return_token_ids and delta.token_ids
        if not (parts or delta.logprobs or delta.finished or delta.prompt_logprobs is not None or ids):
            return None  # text held back (half a character, a possible stop string, tag or call)
        message = {"content": parts.content}
        if output.has_reasoning and parts.reasoning:
            message["reasoning_content"] = parts.reasoning
        if parts.tool_calls:
            message["tool_calls"] = parts.tool_calls
        choice = {
            "index": index,
            "delta": message,
            "logprobs": None if delta.logprobs is None else chat_logprobs(self.texts, delta.token_ids, delta.logprobs),
            "finish_reason": output.finish_reason(delta.finish_reason),
        }
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        chunk = self._chunk([choice])
        if delta.prompt_logprobs is not None:
            chunk["prompt_logprobs"] = self._prompt_logprobs(delta.prompt_logprobs)
        return chunk

    def _prompt_logprobs(self, logprobs) -> list[dict | None]:
        """vLLM's top-level `prompt_logprobs` (one prompt, however many choices)."""
        return vllm_prompt_logprobs(self.texts, self.generation.prompt(0), logprobs)

    def response(self) -> dict:
        choices = []
        for i, (choice, output) in enumerate(zip(self.generation.choices, self.outputs)):
            c = choice.completion
            output.feed(c.text)
            output.finish()
            choices.append({
                "index": i,
                "message": output.message(),
                "logprobs": None if c.logprobs is None else chat_logprobs(self.texts, c.token_ids, c.logprobs),
                "finish_reason": output.finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if self.return_token_ids else {}),
            })
        response = {**self.head, "object": "chat.completion", "choices": choices, "usage": self.generation.usage()}
        if self.return_token_ids:
            response["prompt_token_ids"] = self.generation.prompt(0)
        prompt_logprobs = self.generation.choices[0].completion.prompt_logprobs
        if prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs(prompt_logprobs)
        return response
