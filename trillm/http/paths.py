"""Paths a request names (new weights, LoRA adapters): off unless the operator asked, and
inside one directory.

`--enable-weight-updates` opens /update_weights_from_disk (and /update_weights);
`--allow-runtime-lora` opens /v1/load_lora_adapter, /v1/unload_lora_adapter and loading
from a completion's `lora_request.lora_path` (vLLM keeps the same behind an environment
variable). Either needs `--allowed-weights-dir`: a path is resolved first (symlinks followed,
`..` collapsed) and must then lie inside that directory, so neither a link nor a relative
path leads out. A path outside gets the same answer whether or not anything is there, so the
server is no oracle for what exists on its disk; and the loaders' refusals that a client sees
name what is wrong, never a file's content.
"""
from __future__ import annotations

import os

from trillm.http.errors import APIError
from trillm.http.settings import ServerSettings


def check_settings(settings: ServerSettings) -> None:
    """ValueError at start for an opt-in with nowhere to read from."""
    if (settings.enable_weight_updates or settings.allow_runtime_lora) and not settings.allowed_weights_dir:
        raise ValueError("--enable-weight-updates and --allow-runtime-lora need --allowed-weights-dir: the "
                         "directory whose contents requests may load.")
    if settings.allow_runtime_lora and not settings.engine.enable_lora:
        raise ValueError("--allow-runtime-lora needs --enable-lora.")
    if settings.max_lora_adapters < 1:
        raise ValueError("--max-lora-adapters must be at least 1.")


def require(enabled: bool, flag: str, what: str) -> None:
    """A 403 naming the flag that turns `what` on, unless it is on."""
    if not enabled:
        raise APIError(403, f"{what} is off on this server; its operator can turn it on with {flag}.")


def allowed_path(settings: ServerSettings, path: str, param: str) -> str:
    """`path`, resolved, if it lies inside --allowed-weights-dir; a 403 naming `param` otherwise
    (the same words whether or not the path exists)."""
    root = os.path.realpath(settings.allowed_weights_dir or "")
    resolved = os.path.realpath(path) if path and "\0" not in path else ""
    if not settings.allowed_weights_dir or not resolved or os.path.commonpath([root, resolved]) != root:
        raise APIError(403, f"{param} must name a path inside the directory this server allows "
                            "(--allowed-weights-dir).", param)
    return resolved
