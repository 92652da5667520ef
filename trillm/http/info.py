"""Read-only endpoints: health, models, model and server info, version, load, metrics."""
from __future__ import annotations

import dataclasses
import time

from quart import Blueprint, Response

import trillm
from trillm.http.errors import error_response
from trillm.http.metrics import CONTENT_TYPE
from trillm.http.state import current

blueprint = Blueprint("info", __name__)
_STARTED = int(time.time())


@blueprint.get("/health")
@blueprint.route("/ping", methods=["GET", "POST"])
async def health():
    """200 while the engine runs and takes requests; 503 once it died or the server drains."""
    engine = current().engine
    if engine.error is not None:
        return error_response(503, f"The engine stopped: {engine.error!r}")
    if not engine.accepting:
        return error_response(503, "The server is shutting down.")
    return Response("", status=200)


def _model_card(state, adapter=None) -> dict:
    """OpenAI's model object with vLLM's fields (`root`, `parent`, `max_model_len`, `permission`),
    which vLLM's clients and UIs read: of the base model, or of a LoRA adapter (`root` its
    directory, `parent` the base model)."""
    name = state.model_name if adapter is None else adapter.name
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "trillm",
        "root": state.weights_path if adapter is None else adapter.path,
        "parent": None if adapter is None else state.model_name,
        "max_model_len": state.max_model_len,
        "permission": [{
            "id": f"modelperm-{name}", "object": "model_permission", "created": _STARTED,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    }


@blueprint.get("/v1/models")
async def models():
    state = current()
    adapters = state.engine.adapters.values()
    return {"object": "list", "data": [_model_card(state), *(_model_card(state, a) for a in adapters)]}


@blueprint.get("/v1/models/<path:model>")
async def model(model: str):
    state = current()
    state.check_model(model)
    return _model_card(state, None if model == state.model_name else state.engine.adapters[model])


@blueprint.get("/model_info")
async def model_info():
    state = current()
    config = state.engine.config.hf_config
    return {
        "model_path": state.weights_path,
        "served_model_name": state.model_name,
        "architectures": getattr(config, "architectures", None),
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,
        "eos_token_id": state.engine.config.eos_token_id,
        "is_generation": True,
    }


@blueprint.get("/server_info")
async def server_info():
    """trillm's settings and stats, and at the top level the fields of SGLang's server info that
    sglang-router reads when a worker joins (the model's name for its /v1/models among them).
    Not `model_path`: the router would try to fetch a tokenizer by that name from a model hub."""
    state = current()
    stats = dataclasses.asdict(state.engine.stats())
    engine = state.settings.engine
    config = state.engine.config.hf_config
    sglang = {
        "served_model_name": state.model_name, "is_generation": True,
        "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None),
        "tp_size": engine.tensor_parallel_size, "dp_size": 1, "max_running_requests": engine.max_num_seqs,
        "max_prefill_tokens": state.engine.config.max_num_batched_tokens,
    }
    return {**sglang, "version": trillm.__version__, "settings": state.settings.redacted(), "stats": stats}


@blueprint.get("/version")
async def version():
    return {"version": trillm.__version__}


@blueprint.get("/load")
async def load():
    stats = current().engine.stats()
    return {
        "server_load": stats.num_live_requests,
        "num_requests_running": stats.num_running,
        "num_requests_waiting": stats.num_waiting,
    }


@blueprint.get("/get_load")
async def get_load():
    """What vllm-router polls for its power_of_two policy and /get_loads: `load`, the tokens live
    requests hold in the KV cache (SGLang's `num_tokens`), beside SGLang's per-rank fields."""
    state = current()
    stats = state.engine.stats()
    tokens = stats.num_used_blocks * state.settings.engine.block_size
    return {"load": tokens, "num_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting, "num_tokens": tokens}


@blueprint.get("/metrics")
async def metrics():
    return Response(current().metrics.render(), content_type=CONTENT_TYPE)
