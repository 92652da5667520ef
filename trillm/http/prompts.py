"""From a request's prompt (messages, text, token ids, or lists of them) to token-id lists.

Chat messages go through the model's chat template as text, then are tokenized
without adding special tokens: the template already holds any BOS, and adding
one again would change what the model sees (the offline `LLM.chat` does the same).

A model made from a bare config has no tokenizer: it takes token ids only, and
anything that needs text is a 400 naming the field that carried it.
"""
from __future__ import annotations

import jinja2

from trillm.http.protocol.chat import ChatMessage, Tool
from trillm.http.protocol.common import TemplateOptions
from trillm.http.tools import template_inputs
from trillm.sampling_params import SamplingParamError


def chat_prompt(
    tokenizer,
    messages: list[ChatMessage],
    options: TemplateOptions = TemplateOptions(),
    tools: list[Tool] | None = None,
) -> list[int]:
    """`options` say which template renders the messages and how (see TemplateOptions); `tools`
    are shown to the model as trillm.http.tools describes."""
    if not messages:
        raise SamplingParamError("messages", "messages must hold at least one message.")
    require_tokenizer(tokenizer, "messages")
    template = options.chat_template or tokenizer.chat_template
    rendered, tool_kwargs = template_inputs(template, [m.for_template() for m in messages], tools)
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            chat_template=options.chat_template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            documents=options.documents,
            tokenize=False,
            **tool_kwargs,
            **(options.kwargs or {}),
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        # The template refused these messages (e.g. roles that do not alternate), or did not parse.
        param = "chat_template" if options.chat_template is not None else "messages"
        raise SamplingParamError(param, f"The chat template cannot render these messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=options.add_special_tokens)


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """One token-id list per prompt. An empty one is left for the engine to refuse with its own words."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt, "prompt")]
    if not prompt:
        raise SamplingParamError("prompt", "The prompt is empty.")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [encode(tokenizer, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


def require_tokenizer(tokenizer, param: str) -> None:
    if tokenizer is None:
        raise SamplingParamError(param, "This model has no tokenizer: send prompts as token ids.")


def encode(tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    require_tokenizer(tokenizer, param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def decode(tokenizer, token_ids: list[int]) -> str:
    """Token ids as text; "" for a model without a tokenizer, whose outputs carry no text either."""
    return "" if tokenizer is None else tokenizer.decode(token_ids)
