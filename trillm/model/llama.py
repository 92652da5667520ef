"""Llama-family decoders (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) and Gemma 3's text
decoder on the paged KV cache.

Why not transformers' own modules: our batch is flat (the new tokens of many requests back to back,
no padding), keys and values live in the paged cache the scheduler hands out, and projections that
read the same input are fused (q|k|v and gate|up), so a layer runs four matmuls instead of seven.
Every op goes through the kernel family (trillm/kernels/family.py: torch references, their
compiled CPU versions, or the Triton twins).

Parameter names are the HF checkpoint's, except the fused ones; the loader (trillm/model/loader.py)
maps HF tensors onto them. The variants differ only in config fields: attention bias (Qwen2's
q/k/v; Llama's `attention_bias`), Qwen3's per-head q/k RMSNorm, a sliding window (Mistral's
`sliding_window`, Qwen's per-layer `layer_types`), head_dim, tied embeddings and the RoPE type.
Gemma 3 adds to those (GEMMA): q/k norms, a norm after attention and around the MLP (the
"sandwich"), GeGLU, embeddings scaled by sqrt(hidden), the attention scaled by
query_pre_attn_scalar, and a RoPE base per layer type (its sliding layers' local one). Its norms
multiply by 1 + w where the others multiply by w: RMSNorm here always multiplies by its weight,
and the loader hands Gemma's norms over as 1 + w (a GGUF file stores them so already).
"""
from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from trillm.kernels.attention_metadata import AttentionMetadata
from trillm.model.parallel import SINGLE, TensorParallel
from trillm.kernels import linear_cpu, quant
from trillm.kernels.family import Kernels

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
GEMMA = frozenset({"gemma3_text"})
QK_NORM = frozenset({"qwen3", "gemma3_text"})
QKV_BIAS = frozenset({"qwen2"})  # q/k/v biases by type; a Llama's are its config's attention_bias

def _empty(*shape: int) -> nn.Parameter:
    """Parameters start uninitialized: the loader writes every one of them, and skipping torch's
    random init saves about a second per 100M parameters."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), where W stacks `shard_sizes` rows: several HF projections of one input.

    Under tensor parallelism a projection holds this rank's share of W. Column-parallel ones
    (qkv, gate_up, lm_head) hold some output rows and need nothing more; a row-parallel one
    (o_proj, down_proj: `reduce` given) holds some input columns, so its output is a partial
    sum that is all-reduced over the ranks, and its bias (whole on every rank) is added once,
    after the sum.

    With LoRA (trillm/model/lora.py: `attach_lora` sets `lora`), each row of a step whose
    adapter slot is set adds its adapter's update to the output, whatever runs the base
    projection (dense, packed or GGUF blocks)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, reduce: TensorParallel | None = None):
        super().__init__()
        self.shard_offsets = [0, *itertools.accumulate(shard_sizes)]
        self.in_features = in_features
        self.weight = _empty(self.shard_offsets[-1], in_features)
        self.dtype, self.device = self.weight.dtype, self.weight.device  # the weight may move to other forms
        self.bias = _empty(self.shard_offsets[-1]) if bias else None
        self.packed_weight: torch.Tensor | None = None  # set by pack(), which drops the plain weight
        self.quantized = None  # set by quantize(), which drops it too: (x, bias) -> y
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.lora = None  # a LinearLoRA once adapters may apply here

    def quantize(self, weight: quant.QuantizedWeight, quantized_linear) -> None:
        """Runs this projection on GGUF blocks (through the backend's `quantized_linear`, e.g.
        trillm/kernels/quant_cpu.pyx) instead of the fp32 weight they dequantize to, loaded or
        not; the plain weight is released."""
        assert self.packed_weight is None and self.quantized is None
        assert (weight.out_features, weight.in_features) == tuple(self.weight.shape), (weight, self.weight.shape)
        self.quantized = quantized_linear(weight)
        self.weight = None

    def pack(self) -> None:
        """Moves the loaded weight into oneDNN's packed layout (trillm/kernels/linear_cpu.py),
        which runs decode-sized batches about twice as fast on CPU. The plain weight is released
        (a tied embedding keeps its own reference), so packing costs no memory."""
        assert self.packed_weight is None
        self.packed_weight = linear_cpu.pack(self.weight)
        self.weight = None

    @property
    def num_shards(self) -> int:
        return len(self.shard_offsets) - 1

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.shard_offsets[index], self.shard_offsets[index + 1]
        return param.narrow(0, start, end - start)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where the quantized CPU kernel may write the result (fp32, [rows, out
        features]); the other paths return a tensor of their own."""
        y = self._matmul(x, self.bias if self.reduce is None else None, out)
        if self.lora is not None and self.lora.batch.slots is not None:
            self.lora.add(y, x)
        if self.reduce is None:
            return y
        y = self.reduce.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, bias, out)
        if self.packed_weight is not None:
            return linear_cpu.linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)


class Embedding(nn.Module):
    """The token embedding; under tensor parallelism, this rank's vocabulary rows: ids outside
    them look up zeros, and the all-reduce sums each id's one real row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.start, self.end = tp.split(vocab_size)
        self.weight = _empty(self.end - self.start, hidden_size)
        self.tp = tp
        self.rows = None  # set by from_rows(): ids -> their rows, in place of the dense table

    def from_rows(self, rows) -> None:
        """Looks tokens up through `rows` (ids [T] -> [T, hidden]: a GGUF file's embeddings as its
        blocks, trillm/model/gguf_weights.EmbeddingRows) instead of a dense table, which is
        released: a large vocabulary's fp32 table would outweigh the quantized file. One rank."""
        assert self.tp.size == 1 and (rows.num_embeddings, rows.embedding_dim) == tuple(self.weight.shape)
        self.rows = rows
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(input_ids)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        rows = F.embedding((input_ids - self.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(1), 0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: Kernels):
        super().__init__()
        self.weight = _empty(size)
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without a residual: norm(x). With one: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters_of(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The RoPE parameters of a layer type where the config keeps them per type (Gemma 3: its
    "sliding_attention" and "full_attention" layers), else the config's one set."""
    parameters = config.rope_parameters
    return parameters[layer_type] if layer_type in parameters else parameters


ROPE_ROWS = 1024  # the RoPE tables' first size on CPU (LlamaModel)


def rope_cos_sin_cache(config: PretrainedConfig, max_positions: int, layer_type: str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos | sin of every position, times the RoPE type's
    attention scaling (1 except yarn / longrope), for the layers of `layer_type` where the
    config's parameters differ by type. Frequencies come from transformers' own
    functions (the default type from its formula, repeated here), so every rope_type (llama3,
    yarn, linear, ...) matches it exactly; "dynamic"
    and "longrope" are taken at their max-length setting, not re-derived per sequence."""
    parameters = rope_parameters_of(config, layer_type)
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":  # transformers' compute_default_rope_parameters, op for op
        dim = head_dim_of(config)
        inv_freq = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        # imported here: the module costs a second of start-up that the default type never needs
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if parameters is config.rope_parameters:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)
    assert 2 * inv_freq.numel() == head_dim_of(config), "partial rotary embeddings are not supported"
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scaling


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation_of(config: PretrainedConfig) -> str:
    """The gated MLP's activation: Gemma's config names it `hidden_activation`."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def layer_type_of(config: PretrainedConfig, layer_idx: int) -> str | None:
    layer_types = getattr(config, "layer_types", None)
    return None if layer_types is None else layer_types[layer_idx]


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Qwen2/3 and Gemma 3 mark sliding layers in `layer_types`; Mistral slides on every layer
    when set."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def check_head_split(heads: int, kv_heads: int, ranks: int) -> None:
    """ValueError unless `ranks` tensor-parallel ranks can share these heads (head_shards)."""
    if heads % ranks:
        raise ValueError(f"{heads} attention heads do not split over {ranks} tensor-parallel ranks.")
    if kv_heads % ranks and ranks % kv_heads:
        raise ValueError(f"{kv_heads} KV heads neither split over nor replicate to {ranks} ranks.")


def head_shards(config: PretrainedConfig, tp: TensorParallel) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's [start, end) of the attention heads and of the KV heads. Query heads split
    evenly; KV heads too where there are at least as many as ranks, else each rank keeps the
    one its query heads read (KV heads replicated, as vLLM does)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    check_head_split(heads, kv_heads, tp.size)
    q = tp.split(heads)
    if kv_heads >= tp.size:
        return q, tp.split(kv_heads)
    kv = q[0] * kv_heads // heads
    return q, (kv, kv + 1)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, kernels: Kernels, tp: TensorParallel = SINGLE):
        super().__init__()
        (q_start, q_end), (kv_start, kv_end) = head_shards(config, tp)
        self.num_heads, self.num_kv_heads = q_end - q_start, kv_end - kv_start
        self.head_dim = head_dim_of(config)
        assert self.num_heads % self.num_kv_heads == 0
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type in QKV_BIAS
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.qkv_sizes, qkv_bias)
        self.o_proj = Linear(q_size, [config.hidden_size], attention_bias, reduce=tp)
        if config.model_type in QK_NORM:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.sliding_window = sliding_window_of(config, layer_idx)
        self.layer_type = layer_type_of(config, layer_idx)  # which RoPE cache it reads (LlamaModel._rope_cache)
        self.kernels = kernels

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        self.kernels.rotary_embedding(positions, q, k, cos_sin_cache, True)
        out = self.kernels.attend(q, k, v, *kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(T, -1))


# the gated MLP's activation -> the kernel family's op for it
ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, kernels: Kernels, tp: TensorParallel = SINGLE):
        super().__init__()
        activation = activation_of(config)
        assert activation in ACTIVATIONS, f"unsupported activation {activation!r}"
        bias = getattr(config, "mlp_bias", False)
        start, end = tp.split(config.intermediate_size)
        inter = end - start
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias)
        self.down_proj = Linear(inter, [config.hidden_size], bias, reduce=tp)
        self.activation = activation
        self.act_and_mul = getattr(kernels, ACTIVATIONS[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On CPU a prompt's tokens go through in chunks of MLP_CHUNK_TOKENS: the gated
        intermediate of a whole step (two rows of intermediate_size a token) is too large for
        glibc's heap, so each layer would map and fault in a fresh one, at 1024 tokens of a 1.7B
        model 64 MiB, and again for the activation's. A chunk's are reused from the heap, and
        fewer of them are resident at once. Rows under a LoRA adapter go whole: its slots are
        per row of the step."""
        T = x.shape[0]
        if T <= MLP_CHUNK_TOKENS or x.device.type != "cpu" or self._has_lora_rows():
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        out = torch.empty_like(x)  # hidden_size in and out
        for start in range(0, T, MLP_CHUNK_TOKENS):
            rows = out[start:start + MLP_CHUNK_TOKENS]
            y = self.down_proj(self.act_and_mul(self.gate_up_proj(x[start:start + MLP_CHUNK_TOKENS])), rows)
            if y.data_ptr() != rows.data_ptr():  # the integer kernel wrote into `rows`; other paths make their own
                rows.copy_(y)
        return out

    def _has_lora_rows(self) -> bool:
        return any(p.lora is not None and p.lora.batch.slots is not None for p in (self.gate_up_proj, self.down_proj))


MLP_CHUNK_TOKENS = 256  # the most tokens one MLP call takes on CPU (MLP.forward; figures in benchmarks/README.md)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, kernels: Kernels, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, kernels, tp)
        self.mlp = MLP(config, kernels, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        if config.model_type in GEMMA:  # the sandwich: attention's output normed, the MLP's in and out
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, positions, hidden, residual, cos_sin_cache, kv_cache, meta):
        """The residual add is fused into the next norm: returns (mlp output, residual so far)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, kv_cache, meta)
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, kernels: Kernels, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kernels, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # Gemma 3's sliding layers turn at a base of their own, its full ones at the main one
        per_type = "sliding_attention" in config.rope_parameters
        self.rope_layer_types = ("full_attention", "sliding_attention") if per_type else (None,)
        # The RoPE tables hold the positions steps have reached: on CPU they start at ROPE_ROWS and
        # double as contexts grow (a 128k-position model's table alone is 64 MiB, resident for a
        # server that never goes past a few thousand); on a GPU whole, since a CUDA graph keeps
        # the address it captured.
        self.config = config
        self.register_buffer("cos_sin_cache", None, persistent=False)
        self.register_buffer("cos_sin_cache_sliding", None, persistent=False)
        device = self.embed_tokens.weight.device
        rows = config.max_position_embeddings
        self._set_rope_tables(min(rows, ROPE_ROWS) if device.type == "cpu" else rows, device)
        # Gemma scales the embeddings by sqrt(hidden), rounded to the model's dtype as transformers does
        self.embed_scale = config.hidden_size**0.5 if config.model_type in GEMMA else None
        self.kernels = kernels
        self.tp = tp
        self.decoder_stack = None  # set by fuse_layers()

    def fuse_layers(self) -> bool:
        """Once the weights are loaded (and quantized): let a decode step run every layer in one
        compiled call (the family's decoder_stack) where this model fits it: one rank, every
        projection on the family's integer kernel and without a bias (Qwen3's per-head q/k norms,
        Gemma's sandwich norms, GeGLU and two RoPE tables included). Returns whether it does, and
        logs why not where the family has a stack (the layer-by-layer step is the slower path);
        steps with prompt rows or a LoRA adapter keep the layers."""
        stack = self.kernels.decoder_stack
        if stack is None:
            return False
        reason = self._unfusable()
        if reason is not None:
            log.info("decode steps run layer by layer, slower than the fused decoder stack: %s", reason)
            return False
        specs = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            sandwich = layer.pre_feedforward_layernorm is not None
            # Gemma: the attention's output normed, then the MLP's input with the residual added; Llama: the latter
            post_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            if sandwich:
                assert layer.post_attention_layernorm.eps == layer.post_feedforward_layernorm.eps == post_norm.eps
            specs.append({
                **{name: p.quantized for name, p in projections.items()},
                "input_norm": layer.input_layernorm.weight, "eps": layer.input_layernorm.eps,
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
                "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
                "post_norm": post_norm.weight, "post_eps": post_norm.eps,
                "attn_out_norm": layer.post_attention_layernorm.weight if sandwich else None,
                "mlp_out_norm": layer.post_feedforward_layernorm.weight if sandwich else None,
                "gelu": mlp.activation == "gelu_pytorch_tanh",
                "sliding_rope": self._rope_cache(layer) is self.cos_sin_cache_sliding,
                "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
                "window": attn.sliding_window,
            })
        self.decoder_stack = stack(specs, self.layers[0].self_attn.scale)
        return True

    def _unfusable(self) -> str | None:
        """Why the decoder stack cannot run this model's layers, None when it can."""
        if self.tp.size != 1:
            return "tensor parallelism splits the layers"
        for layer in self.layers:
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            if any(p.bias is not None for p in projections):
                return "its projections have biases"
            if any(type(p.quantized) is not self.kernels.quantized_linear or p.reduce is not None for p in projections):
                return "some projections are not on the integer kernel's blocks (dense weights, or fp32 activations)"
        return None

    def forward(self, input_ids, positions, kv_caches, meta):
        assert len(kv_caches) == len(self.layers)
        if meta.max_seq_len > self.cos_sin_cache.shape[0]:
            self._grow_rope_tables(meta.max_seq_len)
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        if self._fused(meta):
            hidden, residual = self.decoder_stack.run(hidden, positions, meta.slot_mapping, meta.block_tables,
                                                      meta.seq_lens, kv_caches, self.cos_sin_cache,
                                                      self.cos_sin_cache_sliding)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, self._rope_cache(layer), kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _grow_rope_tables(self, positions: int) -> None:
        """Tables of at least `positions` rows: the next power of two, within the model's
        positions. Each row depends on its position alone, so the rows already served stay
        what they were."""
        assert positions <= self.config.max_position_embeddings, (positions, self.config.max_position_embeddings)
        rows = min(1 << (positions - 1).bit_length(), self.config.max_position_embeddings)
        self._set_rope_tables(rows, self.cos_sin_cache.device)

    def _set_rope_tables(self, rows: int, device: torch.device) -> None:
        """The RoPE tables of the first `rows` positions: one, or Gemma's full and sliding ones."""
        tables = [rope_cos_sin_cache(self.config, rows, layer_type).to(device) for layer_type in self.rope_layer_types]
        self.cos_sin_cache = tables[0]
        if len(tables) > 1:
            self.cos_sin_cache_sliding = tables[1]

    def _rope_cache(self, layer: DecoderLayer) -> torch.Tensor:
        if self.cos_sin_cache_sliding is not None and layer.self_attn.layer_type == "sliding_attention":
            return self.cos_sin_cache_sliding
        return self.cos_sin_cache

    def _fused(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs on the decoder stack: every row decodes, and no adapter applies."""
        if self.decoder_stack is None or meta.max_query_len != 1:
            return False
        lora = self.layers[0].self_attn.qkv_proj.lora
        return lora is None or lora.batch.slots is None


class LlamaForCausalLM(nn.Module):
    """Build it in the target dtype and on the target device (torch.device context and default
    dtype): the RoPE cache must stay fp32, which a later `.to(dtype)` would break."""

    def __init__(self, config: PretrainedConfig, kernels: Kernels, tp: TensorParallel = SINGLE):
        """`tp`: this rank's place in a tensor-parallel group; its shard of every projection, of
        the vocabulary and of the heads is built (the loader fills it, trillm/model/loader.py)."""
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Model type {config.model_type!r} is not supported; trillm runs {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        self.config = config
        self.kernels = kernels
        self.tp = tp
        self.model = LlamaModel(config, kernels, tp)
        start, end = tp.split(config.vocab_size)
        self.lm_head = Linear(config.hidden_size, [end - start], False)
        if config.tie_word_embeddings:  # one parameter under two names; named_parameters lists the first
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: per layer (K, V) [num_blocks, block_size, Hk, D].
        Writes this step's keys and values to the cache; returns the final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them on a single rank)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Only for the rows that need a sample: the vocab projection is the largest matmul.
        Under tensor parallelism every rank projects onto its vocabulary rows and the logits
        are gathered whole on every rank (all of them take part; rank 0 samples). `out`: as
        Linear.forward's, on one rank."""
        return self.tp.gather_columns(self.lm_head(hidden, out), self.config.vocab_size)
