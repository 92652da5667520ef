"""POST /v1/completions: a prompt as text, token ids, or a list of either; `echo`; `n` samples each."""
from __future__ import annotations

import time

from quart import Blueprint

from trillm.engine.output import Delta
from trillm.http.generation import Generation
from trillm.http.logprobs import TokenTexts, completion_logprobs
from trillm.http.prompts import completion_prompts, decode
from trillm.http.protocol import CompletionRequest
from trillm.http.sse import UsageChunks, stream_response
from trillm.http.state import current, parse_body, request_id

blueprint = Blueprint("openai_completions", __name__)


@blueprint.post("/v1/completions")
async def completions():
    state = current()
    req = await parse_body(CompletionRequest)
    state.check_model(req.model)
    params = req.to_sampling_params(state.vocab_size)
    prompts = completion_prompts(state.tokenizer, req.prompt)
    generation = Generation(state, *request_id("cmpl"), prompts, params)
    await generation.start()
    echoes = [_prompt_text(state.tokenizer, req.prompt, k, ids) if req.echo else "" for k, ids in enumerate(prompts)]
    chunks = CompletionChunks(generation, req, state.model_name, state.token_texts, echoes)
    if req.stream:
        return stream_response(generation, chunks)
    await generation.run()
    return chunks.response()


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

    def opening(self) -> list[dict]:
        return [
            self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
            for i, echo in enumerate(self.echoes)
            if echo
        ]

    def _logprobs(self, index: int, token_ids: list[int], logprobs) -> dict | None:
        if logprobs is None:
            return None
        out = completion_logprobs(self.texts, token_ids, logprobs, self.text_offsets[index])
        self.text_offsets[index] += sum(map(len, out["tokens"]))
        return out

    def chunk(self, index: int, delta: Delta) -> dict | None:
        if not (delta.text or delta.logprobs or delta.finished):
            return None
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(index, delta.token_ids, delta.logprobs),
            "finish_reason": delta.finish_reason,
        }
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        return self._chunk([choice])

    def response(self) -> dict:
        choices = []
        for i, processor in enumerate(self.generation.processors):
            c = processor.completion
            choices.append({
                "index": i,
                "text": self.echoes[i] + c.text,
                "logprobs": self._logprobs(i, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
        return {**self.head, "choices": choices, "usage": self.generation.usage()}
