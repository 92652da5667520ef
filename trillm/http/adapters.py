"""LoRA adapters while serving: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

A loaded adapter is listed by /v1/models (its `parent`, the base model) and named by requests'
`model` (OpenAI routes), `lora_path` (/generate) or `lora_request` (TensorRT-LLM's field).
The adapter's files are read in a worker thread; registering and forgetting it are the engine's
(AsyncEngine.load_lora / unload_lora), so a request never sees half an adapter.
"""
from __future__ import annotations

from quart import Blueprint, Response

from trillm.engine.lora import LoRAError
from trillm.http.errors import APIError
from trillm.http.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from trillm.http.state import current, parse_body

blueprint = Blueprint("adapters", __name__)


@blueprint.post("/v1/load_lora_adapter")
async def load_lora_adapter():
    """200 with vLLM's text; 400 for an adapter that cannot be served (the message says why) or
    a name already loaded (unless load_inplace, which replaces it when no request uses it)."""
    state = current()
    req = await parse_body(LoadLoRAAdapterRequest)
    try:
        await state.engine.load_lora(req.lora_name, req.lora_path, inplace=req.load_inplace)
    except LoRAError as exc:
        raise APIError(exc.status, str(exc), "lora_path" if exc.status == 400 else "lora_name") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", status=200)


@blueprint.post("/v1/unload_lora_adapter")
async def unload_lora_adapter():
    """200 with vLLM's text; 404 for an unknown name; 400 while running requests use it (the
    client retries once they finish, or aborts them)."""
    state = current()
    req = await parse_body(UnloadLoRAAdapterRequest)
    try:
        state.engine.unload_lora(req.lora_name)
    except LoRAError as exc:
        raise APIError(exc.status, str(exc), "lora_name") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", status=200)
