"""POST /v1/completions: a prompt as text, token ids, or a list of either; `echo`; `n` samples each.

With `echo` and `logprobs`, each choice's logprobs start with the prompt's tokens (the first
one's null), which is what evaluation harnesses score; `max_tokens` 0 then returns the prompt
alone. vLLM's `prompt_logprobs` add a `prompt_logprobs` list to each choice. Prompt logprobs come
with the engine's first output of a choice, so a stream with them sends the echo there, joined
to the first generated text, rather than in an opening chunk."""
from __future__ import annotations

import time

from quart import Blueprint

from trillm.engine.api import Delta
from trillm.http.generation import Generation
from trillm.http.logprobs import TokenTexts, completion_logprobs, join_completion_logprobs, vllm_prompt_logprobs
from trillm.http.prompts import NO_BOUND, completion_prompts, decode
from trillm.http.protocol.completions import CompletionRequest
from trillm.http.sse import UsageChunks, stream_response
from trillm.http.state import model_request, request_id

blueprint = Blueprint("openai_completions", __name__)


@blueprint.post("/v1/completions")
async def completions():
    state, req = await model_request(CompletionRequest)
    params, prompts, echoes = await state.off_loop(_prepare, state, req)
    generation = Generation(state, *request_id("cmpl", req.session_name), prompts, params,
                            lora_name=await state.requested_lora(req.model, req.lora_request))
    await generation.start()
    chunks = CompletionChunks(generation, req, req.model or state.model_name, state.token_texts, echoes)
    if req.stream:
        return stream_response(generation, chunks)
    await generation.run()
    return chunks.response()


def _prepare(state, req: CompletionRequest) -> tuple:
    """The sampling params, each prompt's token ids and its echo (off the event loop: the work
    grows with the request)."""
    params = req.to_sampling_params(state.vocab_size, state.tokenizer)
    bound = state.prompt_bound if req.truncate_prompt_tokens is None else NO_BOUND  # truncated: any length
    prompts = [req.truncated(p, state.max_model_len) for p in completion_prompts(state.tokenizer, req.prompt, bound)]
    # A truncated prompt is echoed as what the model saw: its remaining tokens.
    sent = req.prompt if req.truncate_prompt_tokens is None else prompts
    echoes = [_prompt_text(state.tokenizer, sent, k, ids) if req.echo else "" for k, ids in enumerate(prompts)]
    return params, prompts, echoes


def _prompt_text(tokenizer, prompt, k: int, ids: list[int]) -> str:
    """What echo repeats: the prompt as sent when it was text, else its decoded ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt[k], str):
        return prompt[k]
    return decode(tokenizer, ids)


class CompletionChunks(UsageChunks):
    def __init__(
        self, generation: Generation, req: CompletionRequest, model: str, texts: TokenTexts, echoes: list[str]
    ):
        self.head = {
            "id": generation.request_id, "object": "text_completion", "created": int(time.time()), "model": model
        }
        super().__init__(generation, req, self.head)
        self.texts = texts
        self.echoes = [echoes[i // generation.n] for i in range(generation.num_choices)]  # per choice
        self.text_offsets = [len(e) for e in self.echoes]  # where each choice's next token starts
        self._started: set[int] = set()  # choices whose first chunk has gone
        # Where the prompt's logprobs go: the echo's (OpenAI's), vLLM's prompt_logprobs, or both.
        self.echo_logprobs = req.echo_logprobs
        self.vllm_prompt_logprobs = req.prompt_logprobs is not None
        self.return_token_ids = req.return_token_ids  # each choice's prompt_token_ids and token_ids (vLLM's)

    def opening(self) -> list[dict]:
        if self.echo_logprobs:
            return []  # the echo goes with the prompt's logprobs, in the choice's first chunk
        return [
            self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
            for i, echo in enumerate(self.echoes)
            if echo
        ]

    def _logprobs(self, index: int, token_ids: list[int], logprobs, prompt_logprobs=None) -> dict | None:
        """The choice's logprobs for these new tokens, after the echoed prompt's when
        `prompt_logprobs` (the engine's, from position 0) arrived with them."""
        if logprobs is None:
            return None
        out = completion_logprobs(self.texts, token_ids, logprobs, self.text_offsets[index])
        self.text_offsets[index] += sum(map(len, out["tokens"]))
        if self.echo_logprobs and prompt_logprobs is not None:
            out = join_completion_logprobs(completion_logprobs(self.texts, self.generation.prompt(index), prompt_logprobs, 0), out)
        return out

    def _choice(self, index: int, text: str, logprobs: dict | None, finish_reason, prompt_logprobs,
                token_ids: list[int], first: bool) -> dict:
        """`first`: the choice's first chunk (or its whole answer), which carries its prompt's ids."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.vllm_prompt_logprobs and prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.texts, self.generation.prompt(index), prompt_logprobs)
        if self.return_token_ids:
            choice["prompt_token_ids"] = self.generation.prompt(index) if first else None
            choice["token_ids"] = token_ids
        return choice

    def chunk(self, index: int, delta: Delta) -> dict | None:
        ids = self.return_token_ids and delta.token_ids
        if not (delta.text or delta.logprobs or delta.finished or delta.prompt_logprobs is not None or ids):
            return None
        text = delta.text
        if self.echo_logprobs and delta.prompt_logprobs is not None:
            text = self.echoes[index] + text
        logprobs = self._logprobs(index, delta.token_ids, delta.logprobs, delta.prompt_logprobs)
        first = index not in self._started
        self._started.add(index)
        choice = self._choice(index, text, logprobs, delta.finish_reason, delta.prompt_logprobs, delta.token_ids, first)
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        return self._chunk([choice])

    def response(self) -> dict:
        choices = []
        for i, choice in enumerate(self.generation.choices):
            c = choice.completion
            logprobs = self._logprobs(i, c.token_ids, c.logprobs, c.prompt_logprobs)
            choice = self._choice(i, self.echoes[i] + c.text, logprobs, c.finish_reason, c.prompt_logprobs,
                                  c.token_ids, True)
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        response = {**self.head, "choices": choices, "usage": self.generation.usage()}
        if self.return_token_ids:  # TensorRT-LLM's place for them: one list per prompt, or the one list
            prompts = self.generation.prompts
            response["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
        return response
