"""LoRA adapters: read from PEFT directories, kept in host memory, placed in the model's slots.

Three owners, three objects:
- `read_adapter` (any thread) turns a PEFT directory into `LoRAWeights`, or a LoRAError that
  says what is wrong with it (a missing file, a rank above the limit, a module the model lacks).
- `LoRARegistry` (the engine's owner: the offline loop, or the AsyncEngine's task between steps)
  maps names to `LoRAAdapter` records: the adapters a request may name. It keeps at most
  `max_cpu_loras` adapters' weights in host memory, dropping the least recently used one no live
  request holds (it is read again from its directory when next asked for), and counts each
  adapter's live requests, so one in use is never dropped nor unloaded.
- `LoRASlots` (the model's, used by the step) holds `max_loras` slots on the model's device:
  per target projection, stacked A and B tensors (`LinearLoRA`). Each step, the adapters of the
  scheduled requests get slots (the scheduler never schedules more than `max_loras` at once),
  an adapter not in one is copied over the least recently used slot that this step does not
  need, and every row of the step names its request's slot (-1: the base model). The
  projections add each row's update with the kernel family's `lora_add` (trillm/kernels/lora.py).

Adapter ids are never reused, so an id names one set of weights for the server's lifetime: the
prefix cache keys an adapter's blocks by it (the cache salt), and a slot holding an unloaded
adapter's weights can never be mistaken for another's.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from trillm.model.llama import Linear, LlamaForCausalLM, head_dim_of

# PEFT's module names -> (the layer's submodule, its fused projection, the part of it)
TARGETS = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


class LoRAError(ValueError):
    """An adapter that cannot be served, or a name that cannot be loaded or unloaded: the message
    says why (the server's 400). `status` 404: no adapter has that name."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # pickled across the engine's process boundary, with its status
        return type(self), (str(self), self.status)


def module_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target module, as in the HF checkpoint."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter's tensors in host memory, fp32: per (layer, PEFT module name), A [r, in] and
    B [out, r] with its scaling (lora_alpha / r, or / sqrt(r) under rsLoRA) folded in."""

    rank: int
    parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.parts.values())


def read_adapter(path: str, config: PretrainedConfig, max_rank: int) -> LoRAWeights:
    """A PEFT LoRA directory's weights, checked against the base model `config` and the rank limit;
    LoRAError naming what does not fit. Reads files only: safe in any thread."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise LoRAError(f"The LoRA adapter at {path!r} has no {os.path.basename(needed)}: "
                            f"an adapter is a PEFT directory ({CONFIG_FILE} and {WEIGHTS_FILE}).")
    try:
        with open(config_path, encoding="utf-8") as f:
            peft_config = json.load(f)
    except (OSError, ValueError):
        raise LoRAError(f"The LoRA adapter's {CONFIG_FILE} at {path!r} cannot be read as JSON.") from None
    if not isinstance(peft_config, dict) or peft_config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"The adapter at {path!r} is not a LoRA adapter (its peft_type is not LORA).")
    rank, alpha = peft_config.get("r"), peft_config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"The LoRA adapter at {path!r} needs a positive integer r and a lora_alpha.")
    if rank > max_rank:
        raise LoRAError(f"The LoRA adapter at {path!r} has rank {rank}; this server takes ranks up to "
                        f"{max_rank} (--max-lora-rank).")
    for key, allowed in (("use_dora", (False, None)), ("modules_to_save", (None, [])), ("bias", ("none", None)),
                         ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None))):
        if peft_config.get(key) not in allowed:
            raise LoRAError(f"The LoRA adapter at {path!r} sets {key}, which trillm does not serve.")
    targets = peft_config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"The LoRA adapter at {path!r} has a target_modules that is not a list of module names.")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        # module names are named back only when they look like one, so no other text of the file is
        names = [m for m in unknown if _MODULE_NAME.fullmatch(m)]
        raise LoRAError(f"The LoRA adapter at {path!r} targets modules trillm does not apply adapters to"
                        f"{' (' + ', '.join(names) + ')' if names else ''}; it applies them to {', '.join(TARGETS)}.")
    scaling = alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for name in f.keys():
                match = _TENSOR_NAME.search(name)
                if match is None or match.group(2) not in TARGETS:
                    raise LoRAError(f"The LoRA adapter at {path!r} has a tensor for a module trillm does "
                                    f"not apply adapters to ({', '.join(TARGETS)}).")
                layer, module, half = int(match.group(1)), match.group(2), match.group(3)
                if layer >= config.num_hidden_layers:
                    raise LoRAError(f"The LoRA adapter at {path!r} has layer {layer}; the model has "
                                    f"{config.num_hidden_layers}.")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(name).float()
    except LoRAError:
        raise
    except Exception:  # noqa: BLE001 - a corrupt file is the client's bad directory
        raise LoRAError(f"The LoRA adapter's {WEIGHTS_FILE} at {path!r} cannot be read as safetensors.") from None
    parts = {}
    for (layer, module), pair in halves.items():
        out_features, in_features = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAError(
                f"The LoRA adapter at {path!r} does not fit this model at layer {layer} {module}: expected A "
                f"{[rank, in_features]} and B {[out_features, rank]}, got "
                f"{None if a is None else list(a.shape)} and {None if b is None else list(b.shape)}.")
        parts[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not parts:
        raise LoRAError(f"The LoRA adapter at {path!r} has no LoRA weights.")
    return LoRAWeights(rank, parts)


@dataclass(eq=False)
class LoRAAdapter:
    """One adapter a request may name: `lora_id` is unique for the server's lifetime;
    `weights` is None while dropped from host memory; `live` counts the engine requests using it."""

    name: str
    path: str
    lora_id: int
    weights: LoRAWeights | None
    live: int = 0


class LoRARegistry:
    """The adapters requests may name (module docstring). Only the engine's owner calls it,
    between steps; a step reads the weights of adapters its requests hold, which are never dropped."""

    def __init__(self, config: PretrainedConfig, max_rank: int, max_cpu_loras: int):
        assert max_rank >= 1 and max_cpu_loras >= 1
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._next_id = 1  # 0 is the base model's, in the scheduler's Request.lora_id

    def read(self, path: str) -> LoRAWeights:
        """`read_adapter` against this model and rank limit (any thread)."""
        return read_adapter(path, self.config, self.max_rank)

    def add(self, name: str, path: str, weights: LoRAWeights) -> LoRAAdapter:
        """Register `weights` (read from `path`) as `name`; LoRAError if the name is taken."""
        if name in self.adapters:
            raise LoRAError(f"The LoRA adapter {name!r} has already been loaded.")
        adapter = LoRAAdapter(name, path, self._next_id, weights)
        self._next_id += 1
        self.adapters[name] = adapter
        self._drop_unused()
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Forget `name`. LoRAError: 404 if unknown; 400 while live requests use it (it is refused,
        not waited for: the caller may retry once they finish, or abort them)."""
        adapter = self.get(name)
        if adapter.live:
            raise LoRAError(f"The LoRA adapter {name!r} is in use by {adapter.live} running requests; unload it once "
                            f"they finish (or abort them).")
        del self.adapters[name]
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRAError(f"The LoRA adapter `{name}` does not exist.", status=404)
        return adapter

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter for a new engine request, its weights in host memory (read again from its
        directory if they were dropped); counted live until `release`."""
        adapter = self.get(name)
        if adapter.weights is None:
            adapter.weights = self.read(adapter.path)
        adapter.live += 1
        self.adapters.move_to_end(name)
        self._drop_unused()
        return adapter

    def release(self, adapter: LoRAAdapter) -> None:
        """One of its engine requests ended."""
        assert adapter.live > 0
        adapter.live -= 1

    @property
    def num_loaded(self) -> int:
        """Adapters whose weights are in host memory."""
        return sum(a.weights is not None for a in self.adapters.values())

    @property
    def nbytes(self) -> int:
        return sum(a.weights.nbytes for a in self.adapters.values() if a.weights is not None)

    def _drop_unused(self) -> None:
        """Keep at most max_cpu_loras adapters' weights, dropping the least recently used unused
        ones; adapters in use stay, even beyond the limit."""
        excess = self.num_loaded - self.max_cpu_loras
        for adapter in self.adapters.values():
            if excess <= 0:
                break
            if adapter.weights is not None and adapter.live == 0:
                adapter.weights = None
                excess -= 1


@dataclass
class LoRABatch:
    """The running step's slot per row ([T] int64, -1: none), or None when no row uses an adapter."""

    slots: torch.Tensor | None = None


class LinearLoRA:
    """A projection's slots: a [S, parts * R, in] (each part's A rows at part * R), b [S, parts * R,
    out] (each part's B, transposed, as a block on the diagonal), zero where an adapter has nothing."""

    def __init__(self, linear: Linear, modules: list[str], num_slots: int, max_rank: int, batch: LoRABatch, lora_add):
        in_features = linear.in_features
        out_features = linear.shard_offsets[-1]
        dtype, device = linear.dtype, linear.device
        self.modules = modules  # the PEFT module of each part, in order
        self.offsets = linear.shard_offsets
        # where each part's outputs start, for the kernels that skip b's zero blocks (made once)
        self.out_offsets = torch.tensor(self.offsets, dtype=torch.int64)
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(modules) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, len(modules) * max_rank, out_features, dtype=dtype, device=device)
        self.batch = batch
        self.lora_add = lora_add

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter update, in place."""
        self.lora_add(y, x, self.a, self.b, self.batch.slots, self.out_offsets)

    def load(self, slot: int, layer: int, weights: LoRAWeights) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        R, r = self.max_rank, weights.rank
        for part, module in enumerate(self.modules):
            pair = weights.parts.get((layer, module))
            if pair is not None:
                a, b = pair
                self.a[slot, part * R:part * R + r].copy_(a)
                self.b[slot, part * R:part * R + r, self.offsets[part]:self.offsets[part + 1]].copy_(b.T)


@dataclass
class LoRASlots:
    """The model's adapter slots (module docstring); `assign` runs on the step's thread."""

    layers: list[tuple[int, LinearLoRA]]
    batch: LoRABatch
    owners: list[int | None] = field(default_factory=list)  # lora_id in each slot, least recently used first
    order: list[int] = field(default_factory=list)  # slot indices, least recently used first

    def assign(self, adapters: list[LoRAAdapter | None]) -> list[int] | None:
        """Each request's slot (-1: no adapter), loading adapters not in one; None when no request
        of the step uses an adapter. At most len(owners) distinct adapters (the scheduler's bound)."""
        wanted = {a.lora_id: a for a in adapters if a is not None}
        if not wanted:
            return None
        assert len(wanted) <= len(self.owners), "the scheduler admits at most max_loras adapters at once"
        for lora_id, adapter in wanted.items():
            if lora_id not in self.owners:
                slot = next(s for s in self.order if self.owners[s] not in wanted)
                assert adapter.weights is not None, "a live request's adapter keeps its weights"
                for layer, projection in self.layers:
                    projection.load(slot, layer, adapter.weights)
                self.owners[slot] = lora_id
            slot = self.owners.index(lora_id)
            self.order.remove(slot)
            self.order.append(slot)
        return [-1 if a is None else self.owners.index(a.lora_id) for a in adapters]


def attach_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int) -> LoRASlots:
    """Give every target projection of `model` its slots; the model then adds adapters' updates
    in the steps whose LoRABatch names slots."""
    batch = LoRABatch()
    grouped: dict[tuple[str, str], list[str]] = {}  # (submodule, projection) -> its parts' PEFT modules
    for module, (sub, proj, _) in TARGETS.items():
        grouped.setdefault((sub, proj), []).append(module)
    layers = []
    for i, layer in enumerate(model.model.layers):
        for (sub, proj), modules in grouped.items():
            linear = getattr(getattr(layer, sub), proj)
            assert linear.num_shards == len(modules), (proj, linear.num_shards)
            linear.lora = LinearLoRA(linear, modules, max_loras, max_rank, batch, model.kernels.lora_add)
            layers.append((i, linear.lora))
    return LoRASlots(layers, batch, [None] * max_loras, list(range(max_loras)))
