"""Chat templates that requests bring (--trust-request-chat-template), rendered where they cannot
take the server's cores or memory.

Trusting a client's template means trusting it with the prompt, not with the server: a template
is code, and one of `range` loops or doubling strings ran for seconds or took the better part
of a gigabyte inside the server. Each render runs in a fork of a worker process
(trillm/fork_jobs.py), stopped after RENDER_SECONDS and held to RENDER_MEMORY bytes beyond
what the worker holds; the model's own template still renders in the server.

The worker starts on the first such request (it imports transformers' template renderer) and
is given the tokenizer's special tokens, which templates read (bos_token, eos_token, ...). A
fork renders as `apply_chat_template` does, with transformers' own `render_jinja_template`:
messages without their None fields, the special tokens under the request's template kwargs.

A job: {"template", "messages", "tools", "documents", "add_generation_prompt",
"continue_final_message", "kwargs"}; its reply: {"text"} or {"error"}.
"""
from __future__ import annotations

import json
import logging

from trillm.fork_jobs import ForkWorker, JobOutOfMemory, JobTimeout, WorkerClosed, WorkerOnDemand
from trillm.http.protocol.common import TemplateOptions
from trillm.sampling_params import SamplingParamError

log = logging.getLogger(__name__)
RENDER_SECONDS = 2.0  # a template a request brought renders within this, or is a 400
RENDER_MEMORY = 256 << 20  # bytes a render may allocate
RENDER_SLOTS = 2  # renders at once (the server prepares two requests at once)


class RequestTemplates:
    """The renders of one server's request templates. Thread-safe (routes render in worker
    threads); `close()` stops the worker (idempotent; a render after it starts a new one); a
    context manager."""

    def __init__(self, tokenizer):
        self._special_tokens = json.dumps(dict(tokenizer.special_tokens_map), default=str).encode()
        self._workers = WorkerOnDemand()  # started on the first render

    def render(self, template: str, messages: list[dict], options: TemplateOptions,
               tools: list[dict] | None) -> str:
        """The prompt text `template` makes of `messages` and `tools`, as `options` say. Raises
        SamplingParamError (param chat_template) for a template that fails on them, runs past
        RENDER_SECONDS or allocates past RENDER_MEMORY. Blocks while RENDER_SLOTS renders run."""
        job = {"template": template, "messages": messages, "tools": tools, "documents": options.documents,
               "add_generation_prompt": options.add_generation_prompt,
               "continue_final_message": options.continue_final_message, "kwargs": options.kwargs}
        try:
            worker = self._workers.get(lambda: ForkWorker(__name__, self._special_tokens, RENDER_SLOTS,
                                                          "chat template renderer"))
            reply = worker.run(job, RENDER_SECONDS, RENDER_MEMORY)
        except JobTimeout:
            raise SamplingParamError("chat_template", f"The chat template did not render within "
                                                      f"{RENDER_SECONDS:g} s.") from None
        except JobOutOfMemory:
            raise SamplingParamError("chat_template", f"The chat template needed more than "
                                                      f"{RENDER_MEMORY >> 20} MiB to render.") from None
        except WorkerClosed:
            raise SamplingParamError("chat_template", "The chat template was not rendered: the server is "
                                                      "stopping.") from None
        except RuntimeError:
            log.exception("Rendering a request's chat template failed")
            raise SamplingParamError("chat_template", "The chat template could not be rendered.") from None
        if "error" in reply:
            raise SamplingParamError("chat_template", f"The chat template cannot render these messages: "
                                                      f"{reply['error']}")
        return reply["text"]

    def close(self) -> None:
        self._workers.close()

    def __enter__(self) -> RequestTemplates:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def setup(special_tokens: bytes) -> dict:
    """The worker's state: the special tokens; transformers' renderer imported before any fork."""
    import transformers.utils.chat_template_utils  # noqa: F401

    return json.loads(special_tokens)


def run(special_tokens: dict, job: dict) -> dict:
    """One render, in a fork of the worker."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{key: value for key, value in m.items() if value is not None} for m in job["messages"]]
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=job["tools"], documents=job["documents"], chat_template=job["template"],
            add_generation_prompt=job["add_generation_prompt"], continue_final_message=job["continue_final_message"],
            **{**special_tokens, **(job["kwargs"] or {})},
        )
    except (jinja2.TemplateError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        # The template refused these messages, did not parse, asked its sandbox for a range past its
        # bound, or recursed without end.
        return {"error": str(exc)}
    return {"text": rendered[0]}
