"""The server's settings that name what this server has not (a tool-call or reasoning parser, a
metrics prefix) or opt in without what they need (trillm/http/paths.py): refused by `trillm
serve` before the model loads, and by every ServerState again. Imports no metrics: several HTTP
fronts choose prometheus_client's multiprocess mode before it is imported (launch/fronts.py)."""
from __future__ import annotations

from trillm.http import paths
from trillm.http.reasoning import REASONING_PARSERS
from trillm.http.settings import ServerSettings
from trillm.http.tool_parsers import TOOL_PARSERS


def check_settings(settings: ServerSettings) -> None:
    """ValueError, naming the flag's setting, for the first of `settings` this server refuses."""
    for name, value, known in (
        ("tool_call_parser", settings.tool_call_parser, [*TOOL_PARSERS, "none"]),
        ("reasoning_parser", settings.reasoning_parser, REASONING_PARSERS),
        ("metrics_prefix", settings.metrics_prefix, ("trillm", "vllm")),
    ):
        if value is not None and value not in known:
            raise ValueError(f"Unknown {name} {value!r}; known: {', '.join(known)}.")
    paths.check_settings(settings)
