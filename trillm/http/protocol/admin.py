"""The admin routes' bodies: LoRA adapters loaded and unloaded, weights updated from disk."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from trillm.http.protocol.common import Strict


class LoadLoRAAdapterRequest(Strict):
    """vLLM's /v1/load_lora_adapter body; `load_inplace` replaces an adapter of the same name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(Strict):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is taken and not used: names are unique)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class UpdateWeightsRequest(Strict):
    """SGLang's update_weights_from_disk body, with trillm's `abort_running` beside SGLang's
    `abort_all_requests` (either aborts running requests instead of waiting for them)."""

    model_path: str = Field(min_length=1)
    load_format: Literal["auto"] | None = None
    abort_running: bool = False
    abort_all_requests: bool = False
