"""What every API family's request bodies share: the strict base model, the bounds on
lists, prompts as a request may send them, stream options, how chat messages become a prompt,
and the client's names for a request (LMDeploy's session id) and its adapter (TensorRT-LLM's
lora_request)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field


MAX_N = 128  # samples per request: more would let one request fill the whole batch


MAX_PROMPTS = 2048  # prompts in one request's list (OpenAI's bound for a batch of inputs)


# Bounds on a request's other lists, each refused by its length before any item is read: a
# list's cost (validation, template rendering, a grammar compile, the sampler's masks) grows
# with it, and the body limit alone lets through millions of short items. Inside a union, the
# bound goes on the list member (`str | Annotated[list[str], Field(max_length=...)]`), where
# pydantic checks it first: on the union it is checked after every item has failed, each with an
# error of its own, built holding the interpreter lock (seconds, for a body of 300,000 integers).
MAX_LIST_ITEMS = 10_000  # chat messages and their parts, Responses input items, bad_words, stop strings


MAX_TOOLS = 1024  # tools (OpenAI allows 128)


MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice alternatives (one regex; its compile grows with them)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class TemplateOptions:
    """How chat messages become a prompt (trillm.http.prompts.chat_prompt): the chat template's
    extra variables, the template itself (None: the model's), and the peers' switches."""

    kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    add_special_tokens: bool = False  # the template already holds any BOS
    documents: list[dict[str, Any]] | None = None


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class LoRARequest(Strict):
    """TensorRT-LLM's `lora_request`: the adapter to run under, by name; an adapter not loaded yet
    is loaded from `lora_path` first. `lora_int_id` is the client's number for it (trillm numbers
    adapters itself, so it is not used)."""

    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None


def session_name(session_id: int | None) -> str | None:
    """LMDeploy's session id as a client id (-1: none)."""
    return None if session_id is None or session_id == -1 else str(session_id)


def bounded_prompts(value):
    """A list that is not one prompt's token ids is refused by its length before any item is
    validated: each item of a long list would otherwise fail every member of the union in
    turn, and a body of a million strings would build millions of errors."""
    if isinstance(value, list) and len(value) > MAX_PROMPTS and not all(type(v) is int for v in value):
        raise ValueError(f"A request holds at most {MAX_PROMPTS} prompts; this list holds {len(value)}.")
    return value


PromptList = Annotated[list[str], Field(max_length=MAX_PROMPTS)]
# Token ids, as long as a context: not bounded by count, but the first item that is not one fails
# the list, where each would add an error of its own.
TokenIds = Annotated[list[int], Field(fail_fast=True)]


TokenPromptList = Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]


Prompt = Annotated[str | PromptList | TokenIds | TokenPromptList, pydantic.BeforeValidator(bounded_prompts)]


TextList = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
