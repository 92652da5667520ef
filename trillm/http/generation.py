"""One HTTP request's engine work, seen as choices: `async for index, delta in generation`.

Choice k is sample k % n of prompt k // n, OpenAI's order. All choices are one
engine group (see AsyncEngine), so they share one channel and one abort. Each
choice's text is made here, on the Trio side, by its own OutputProcessor while
the engine computes the next step; when a stop string ends a choice, the engine
is told to stop that request, and whatever it still sends for it is dropped.

Always `close()` in `finally`: it aborts what still runs, whether the handler
finished, failed, or its client went away.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import trio

from trillm.engine.api import (
    Delta, FinishReason, OutputProcessor, Params, PoolingProcessor, RequestGroup, RequestStream, num_samples,
    output_processor,
)
from trillm.sampling_params import SamplingParamError, SamplingParams

log = logging.getLogger(__name__)


@contextmanager
def in_client_terms(field_names: dict[str, str]):
    """A SamplingParamError raised inside names the client's field: `field_names` maps the
    engine's (or the chat path's) name for a field to the client's, where they differ."""
    try:
        yield
    except SamplingParamError as exc:
        raise SamplingParamError(field_names.get(exc.param, exc.param), str(exc), exc.status) from None


@dataclass(eq=False)
class Choice:
    """One choice's state on the Trio side: its output processor (text, stop strings, the
    completion so far) and when its last tokens arrived (for the inter-token latency)."""

    processor: OutputProcessor | PoolingProcessor
    last_output: float | None = None

    @property
    def completion(self):
        """The choice's Completion so far (whole once `finished`)."""
        return self.processor.completion

    @property
    def finished(self) -> bool:
        return self.processor.finished


def capped(params: SamplingParams, room: int) -> SamplingParams:
    """`params` asking for at most `room` new tokens (min_tokens within it too), for routes that
    read a limit as a cap, never a demand (Anthropic's max_tokens, Ollama's num_ctx). Unset,
    max_tokens means the context's end, so capping it to the room left there changes nothing."""
    assert room > 0
    if params.max_tokens is not None and params.max_tokens <= room:
        return params
    return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


class Generation:
    def __init__(self, state, request_id: str, client_id: str | None | list[str | None], prompts: list[list[int]],
                 params: Params | list[Params], field_names: dict[str, str] | None = None,
                 lora_name: str | list[str | None] | None = None):
        """`request_id`: the server's id (the engine's key); `client_id`: the client's own name
        for the request, if it gave one (see trillm.http.state.request_id); `field_names`: the
        client's names for the engine's fields where they differ (chat's `messages` for
        `prompt`), so a refusal names the field the client sent. `client_id` and `params` may
        also be one per prompt (SGLang's batch, whose prompts have their own rid and settings).
        `lora_name`: the LoRA adapter every prompt runs under, or one (or None) per prompt."""
        if isinstance(lora_name, list):
            per_prompt = params if isinstance(params, list) else [params] * len(prompts)
            params = [replace(p, lora_name=name) for p, name in zip(per_prompt, lora_name, strict=True)]
        elif lora_name is not None:
            params = [replace(p, lora_name=lora_name) for p in params] if isinstance(params, list) else \
                replace(params, lora_name=lora_name)
        every = params if isinstance(params, list) else [params]
        if any(isinstance(p, SamplingParams) and p.stop for p in every) and state.tokenizer is None:
            raise SamplingParamError("stop", "Stop strings need text, and this model has no tokenizer.")
        self.request_id = request_id
        self.prompts = prompts
        self.n = num_samples(every[0])
        self._engine = state.engine
        self._field_names = field_names or {}
        # Refused before a detokenizer is built for each member: a group too large for the
        # waiting limit costs nothing.
        self._param = "n" if self.n > 1 else "prompt"
        with in_client_terms(self._field_names):
            self._engine.check_room(len(prompts) * self.n, self._param)
        self._metrics = state.metrics
        self._requests = RequestGroup.fan_out(request_id, prompts, params, client_id)
        self.choices = [Choice(output_processor(state.tokenizer, m.prompt_token_ids, m.params, index=k))
                        for k, m in enumerate(self._requests.members)]
        self._arrival = trio.current_time()
        self._stream: RequestStream | None = None
        self._closed = False

    async def start(self) -> None:
        """Wait for the engine to admit every choice; raises what AsyncEngine.add raises."""
        with in_client_terms(self._field_names):
            self._stream = await self._engine.add(self._requests, self._param)
        self._metrics.prompt_tokens.inc(sum(map(len, self.prompts)))

    async def run(self, each: Callable[[Delta], object] | None = None) -> None:
        """For a response that is not streamed: every choice to its end (each delta handed to
        `each`, where given), then close."""
        try:
            async for _, delta in self:
                if each is not None:
                    each(delta)
        finally:
            self.close()

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    def prompt(self, index: int) -> list[int]:
        """The prompt's token ids of choice `index`."""
        return self.prompts[index // self.n]

    @property
    def abort_note(self) -> dict | None:
        """What an abort that ended this generation said about itself (AsyncEngine.abort's note)."""
        return None if self._stream is None else self._stream.abort_note

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        assert self._stream is not None, "start() first"
        while not self.finished:
            index, out = await self._stream.__anext__()
            choice = self.choices[index]
            if choice.finished:
                continue  # a stop string ended it; the engine had not heard yet
            delta = choice.processor.process(out)
            self._observe(choice, len(out.new_token_ids), delta)
            if delta.finished and not out.finished:
                self._stream.stop(index)
            return index, delta
        raise StopAsyncIteration

    def usage(self) -> dict:
        """OpenAI's usage: a prompt counts once however many samples it has; its cached tokens
        are those its first sample found in the prefix cache."""
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.completion.token_ids) for c in self.choices)
        cached = sum(self.choices[k * self.n].completion.num_cached_tokens for k in range(len(self.prompts)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def close(self) -> None:
        """Idempotent. Choices still unfinished (the client went away, or an error) count as aborted."""
        if self._stream is None or self._closed:
            return
        self._closed = True
        self._stream.close()
        now = trio.current_time()
        for choice in self.choices:
            if not choice.finished:
                self._metrics.e2e_latency.observe(now - self._arrival)
                self._metrics.finished(FinishReason.ABORT)
        log.info(
            "%s ended after %.3f s: %s", self.request_id, now - self._arrival,
            ", ".join(f"{c.completion.finish_reason or 'abort (client gone)'} after {len(c.completion.token_ids)} tokens"
                      for c in self.choices),
        )

    def _observe(self, choice: Choice, num_tokens: int, delta: Delta) -> None:
        now = trio.current_time()
        if num_tokens:
            self._metrics.generation_tokens.inc(num_tokens)
            if choice.last_output is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self._metrics.inter_token_latency.observe(now - choice.last_output)
            choice.last_output = now
        if delta.finished:
            self._metrics.e2e_latency.observe(now - self._arrival)
            self._metrics.finished(delta.finish_reason)
