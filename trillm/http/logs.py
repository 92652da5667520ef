"""Log lines that name the request they are about.

Every line logged while a request is handled (its route, its error handlers, its stream to the
end) carries the request's id as `record.request_id` ("-" outside any request), so one grep finds
a request's whole story among hundreds of concurrent ones. The id lives in a context variable:
Trio gives each task its own context, and a request is handled, streamed and closed in one task.
The engine task logs outside any request, so its lines name the request in their text.
"""
from __future__ import annotations

import logging
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id; install it on a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def configure(level: str, front: int = 0) -> None:
    """`trillm serve`'s logging: one line per record, with the request id; a front other than
    the first (--api-server-count) marks its lines with its index."""
    logging.basicConfig(level=level.upper(), format=FORMAT.replace(" [", f" [front {front}] [", 1) if front else FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())


LOGGED_CHARS = 200  # of a value a client chose (user, metadata): a log line stays a line


def clipped(value) -> str:
    """`value`'s repr, cut to LOGGED_CHARS characters (and how many more there were)."""
    text = repr(value)
    if len(text) <= LOGGED_CHARS:
        return text
    return f"{text[:LOGGED_CHARS]}... ({len(text) - LOGGED_CHARS} more characters)"
