"""From a request's prompt (messages, text, token ids, or lists of them) to token-id lists.

Chat messages go through the model's chat template as text, then are tokenized
without adding special tokens: the template already holds any BOS, and adding
one again would change what the model sees (the offline `LLM.chat` does the same).
"""
from __future__ import annotations

import jinja2

from trillm.http.protocol import ChatMessage
from trillm.sampling_params import SamplingParamError


def chat_prompt(
    tokenizer, messages: list[ChatMessage], template_kwargs: dict | None, add_generation_prompt: bool = True
) -> list[int]:
    if not messages:
        raise SamplingParamError("messages", "messages must hold at least one message.")
    try:
        text = tokenizer.apply_chat_template(
            [m.for_template() for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        # The template refused these messages (e.g. roles that do not alternate).
        raise SamplingParamError("messages", f"The chat template cannot render these messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """One token-id list per prompt. An empty one is left for the engine to refuse with its own words."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise SamplingParamError("prompt", "The prompt is empty.")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
