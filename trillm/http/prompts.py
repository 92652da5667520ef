"""From a request's prompt (messages, text, token ids, or lists of them) to token-id lists.

Chat messages go through the model's chat template as text, then are tokenized
without adding special tokens: the template already holds any BOS, and adding
one again would change what the model sees (the offline `LLM.chat` does the same).

A model made from a bare config has no tokenizer: it takes token ids only, and
anything that needs text is a 400 naming the field that carried it.

A text too long for the model's context is refused before it is tokenized (`PromptBound`):
tokenizing costs about a second a megabyte on one core, and a prompt of megabytes would spend
it, and its memory, only to be refused by its length afterwards.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import jinja2

from trillm.engine.api import tokenizer_part
from trillm.http.protocol.chat import ChatMessage, Tool
from trillm.http.protocol.common import TemplateOptions
from trillm.http.request_templates import RequestTemplates
from trillm.http.tools import template_inputs
from trillm.sampling_params import SamplingParamError


log = logging.getLogger(__name__)
# normalizers that map a character to at least one (a text's length then bounds its tokens)
_KEEPS_LENGTH = frozenset({"Replace", "Prepend"})


@dataclass(frozen=True)
class PromptBound:
    """What a text can become at the fewest: each token covers at most `longest` characters of
    the text it was cut from (byte-level BPE: one a byte; SentencePiece: its piece's; a byte
    fallback's six-character name covers one), so a text of n characters is at least
    n / longest tokens. `check` refuses a text that is certainly longer than the context, from
    its length alone."""

    longest: int  # 0: no bound (no tokenizer, or a normalizer that may shorten a text)
    max_model_len: int

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> PromptBound:
        """The bound for this tokenizer (its vocabulary walked once: a fraction of a second)."""
        if tokenizer is None:
            return cls(0, max_model_len)
        normalizer = tokenizer_part(tokenizer, "normalizer")
        steps = [] if normalizer is None else normalizer.get("normalizers", [normalizer])
        if any(step.get("type") not in _KEEPS_LENGTH for step in steps):
            log.info("prompts are tokenized whole before their length is checked: this tokenizer's normalizer "
                     "(%s) may shorten a text", ", ".join(step.get("type", "?") for step in steps))
            return cls(0, max_model_len)
        return cls(_longest_token(tokenizer), max_model_len)

    def check(self, text: str, param: str) -> None:
        """A 400 for `text` when even its fewest tokens exceed the context."""
        if self.longest and len(text) > self.longest * self.max_model_len:
            fewest = math.ceil(len(text) / self.longest)
            raise SamplingParamError(
                param, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                       f"prompt of {len(text)} characters is at least {fewest} tokens long (this model's "
                       f"tokens are at most {self.longest} characters). Please reduce the length of the "
                       "prompt.")


def _longest_token(tokenizer) -> int:
    """The most characters a token of the vocabulary spells, added tokens included: id by id
    through a fast tokenizer's backend (a 262k vocabulary's dict of strings would be tens of
    MiB at start-up, for one number), else through the vocabulary's dict."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return max(map(len, tokenizer.get_vocab()))
    return max(len(backend.id_to_token(i) or "") for i in range(backend.get_vocab_size(with_added_tokens=True)))


NO_BOUND = PromptBound(0, 0)


def chat_prompt(
    tokenizer,
    messages: list[ChatMessage],
    options: TemplateOptions = TemplateOptions(),
    tools: list[Tool] | None = None,
    bound: PromptBound = NO_BOUND,
    templates: RequestTemplates | None = None,
) -> list[int]:
    """`options` say which template renders the messages and how (see TemplateOptions); `tools`
    are shown to the model as trillm.http.tools describes. A template the request brought renders
    in `templates` (trillm.http.request_templates), bounded in time and memory; the model's
    renders here. A rendered text longer than `bound` allows is refused before it is tokenized."""
    if not messages:
        raise SamplingParamError("messages", "messages must hold at least one message.")
    require_tokenizer(tokenizer, "messages")
    template = options.chat_template or tokenizer.chat_template
    rendered, tool_kwargs = template_inputs(template, [m.for_template() for m in messages], tools)
    if options.chat_template is not None:
        assert templates is not None, "a server that takes request templates renders them in a RequestTemplates"
        text = templates.render(options.chat_template, rendered, options, tool_kwargs.get("tools"))
    else:
        try:
            text = tokenizer.apply_chat_template(
                rendered,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                documents=options.documents,
                tokenize=False,
                **tool_kwargs,
                **(options.kwargs or {}),
            )
        except (jinja2.TemplateError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            # e.g. roles that do not alternate
            raise SamplingParamError("messages", f"The chat template cannot render these messages: {exc}") from None
    bound.check(text, "messages")
    return tokenizer.encode(text, add_special_tokens=options.add_special_tokens)


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       bound: PromptBound = NO_BOUND) -> list[list[int]]:
    """One token-id list per prompt (a text longer than `bound` allows refused before any is
    tokenized). An empty one is left for the engine to refuse with its own words."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt, "prompt", bound=bound)]
    if not prompt:
        raise SamplingParamError("prompt", "The prompt is empty.")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    for p in prompt:
        if isinstance(p, str):
            bound.check(p, "prompt")
    return [encode(tokenizer, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


def require_tokenizer(tokenizer, param: str) -> None:
    if tokenizer is None:
        raise SamplingParamError(param, "This model has no tokenizer: send prompts as token ids.")


def encode(tokenizer, text: str, param: str, add_special_tokens: bool = True, bound: PromptBound = NO_BOUND) -> list[int]:
    require_tokenizer(tokenizer, param)
    bound.check(text, param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def decode(tokenizer, token_ids: list[int]) -> str:
    """Token ids as text; "" for a model without a tokenizer, whose outputs carry no text either."""
    return "" if tokenizer is None else tokenizer.decode(token_ids)
