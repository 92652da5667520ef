"""LoRA adapters while serving: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

A loaded adapter is listed by /v1/models (its `parent`, the base model) and named by requests'
`model` (OpenAI routes), `lora_path` (/generate) or `lora_request` (TensorRT-LLM's field).
The adapter's files are read in a worker thread; registering and forgetting it are the engine's
(WeightCycle.load_lora / unload_lora), so a request never sees half an adapter. Behind the
data-parallel router both calls reach every replica (trillm/http/peer_relay.py).
"""
from __future__ import annotations

from quart import Blueprint, Response

from trillm.engine.api import LoRAError
from trillm.http import paths, peer_relay
from trillm.http.errors import APIError
from trillm.http.protocol.admin import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from trillm.http.state import current, parse_body

blueprint = Blueprint("adapters", __name__)


@blueprint.post("/v1/load_lora_adapter")
async def load_lora_adapter():
    """200 with vLLM's text; 400 for an adapter that cannot be served (the message says why) or
    a name already loaded (unless load_inplace, which replaces it when no request uses it) or one
    adapter too many (--max-lora-adapters); 403 unless --allow-runtime-lora, or for a path outside
    --allowed-weights-dir."""
    state = current()
    require_runtime_lora(state)
    req = await parse_body(LoadLoRAAdapterRequest)
    path = paths.allowed_path(state.settings, req.lora_path, "lora_path")
    try:
        await state.engine.weights.load_lora(req.lora_name, path, inplace=req.load_inplace,
                                     limit=state.settings.max_lora_adapters)
    except LoRAError as exc:
        raise APIError(exc.status, str(exc), "lora_path" if exc.status == 400 else "lora_name") from None
    await peer_relay.relay_to_all(state.settings)
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", status=200)


@blueprint.post("/v1/unload_lora_adapter")
async def unload_lora_adapter():
    """200 with vLLM's text; 404 for an unknown name; 400 while running requests use it (the
    client retries once they finish, or aborts them)."""
    state = current()
    require_runtime_lora(state)
    req = await parse_body(UnloadLoRAAdapterRequest)
    try:
        await state.engine.weights.unload_lora(req.lora_name)
    except LoRAError as exc:
        raise APIError(exc.status, str(exc), "lora_name") from None
    await peer_relay.relay_to_all(state.settings)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", status=200)


def require_runtime_lora(state) -> None:
    """A 403 unless the server lets requests load and unload adapters (--allow-runtime-lora)."""
    paths.require(state.settings.allow_runtime_lora, "--allow-runtime-lora", "Loading and unloading LoRA adapters")
