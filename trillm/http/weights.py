"""The weights' life cycle while serving: sleep and wake (vLLM's /sleep, /wake_up, /is_sleeping;
LMDeploy's /wakeup) and updates in place (SGLang's /update_weights_from_disk, also at
/update_weights). The engine does the work (its WeightCycle: sleep, wake_up, update); these
routes read the request and report. Behind the data-parallel router each call that changes the
weights reaches every replica (trillm/http/peer_relay.py).
"""
from __future__ import annotations

from quart import Blueprint, request

from trillm.http import paths, peer_relay
from trillm.http.errors import APIError
from trillm.http.protocol.admin import UpdateWeightsRequest
from trillm.http.state import current, parse_body

blueprint = Blueprint("weights", __name__)


@blueprint.post("/sleep")
async def sleep():
    """`?level=1` (the default: drop the KV cache) or `2` (the weights too). Needs
    --enable-sleep-mode. Running requests finish for up to --drain-timeout, then are aborted;
    the response says how much memory was freed."""
    state = current()
    if not state.settings.engine.enable_sleep_mode:
        raise APIError(400, "Sleep mode needs a server started with --enable-sleep-mode.")
    level = request.args.get("level", "1")
    if level not in ("1", "2"):
        raise APIError(400, f"The sleep level is 1 or 2, got {level!r}.", "level")
    freed = await state.engine.weights.sleep(int(level), state.settings.drain_timeout)
    freed += sum(reply.json()["freed_bytes"] for reply in await peer_relay.relay_to_all(state.settings))
    return {"is_sleeping": True, "level": int(level), "freed_bytes": freed}


@blueprint.post("/wake_up")
@blueprint.post("/wakeup")
async def wake_up():
    """Everything back, or what `?tags=weights` / `?tags=kv_cache` names (vLLM's tags); a server
    that is awake stays so."""
    state = current()
    tags = set(request.args.getlist("tags")) or None
    await state.engine.weights.wake_up(tags)
    await peer_relay.relay_to_all(state.settings)
    return {"is_sleeping": state.engine.sleeping}


@blueprint.get("/is_sleeping")
async def is_sleeping():
    return {"is_sleeping": current().engine.sleeping}


@blueprint.post("/update_weights_from_disk")
@blueprint.post("/update_weights")
async def update_weights():
    """SGLang's body: `model_path` (an HF directory or a GGUF file of the same architecture),
    `abort_all_requests` (or `abort_running`: abort running requests instead of letting them
    finish). Needs --enable-weight-updates, and a path inside --allowed-weights-dir (403s
    otherwise). A path that cannot serve is a 400 and the old weights keep serving."""
    state = current()
    paths.require(state.settings.enable_weight_updates, "--enable-weight-updates", "Updating the weights from a path")
    req = await parse_body(UpdateWeightsRequest)
    path = paths.allowed_path(state.settings, req.model_path, "model_path")
    aborted = await state.engine.weights.update(path, req.abort_running or req.abort_all_requests)
    aborted += sum(reply.json()["num_aborted_requests"] for reply in await peer_relay.relay_to_all(state.settings))
    return {"success": True, "message": f"Serving the weights at {req.model_path}.", "num_paused_requests": 0,
            "num_aborted_requests": aborted}
