# cython: language_level=3
"""A decode step through every decoder layer in one compiled call, for the cpu family.

At one stream a decode step is tens of small kernel calls per layer, and on CPU the Python
between them (the modules' calls, each wrapper's checks and allocations) costs as much as the
weights' reading. `DecoderStack.run` calls the same C kernels the layer-by-layer path calls
(ops_cpu.h, quant_int8_cpu.h, attention_cpu.h), in the same order, with the same arguments, on
buffers of its own, with the GIL released once for the whole stack: its result is the same to
the bit (tests/test_model.py holds this), only the Python between the kernels is gone.

It runs what trillm.model.llama builds it for (`fuse_layers`): every projection on 8-bit integer
dot products with no bias, a per-head q/k norm or none (Qwen3's, Gemma's), Gemma's sandwich (the
attention's and the MLP's outputs normed too, GeGLU, each layer's RoPE table by its type), one
rank, a fp32 or fp16 cache, and only steps where every row decodes (one query per request) with no
LoRA adapter in the step.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.attention_cpu import cache_kind
from trillm.kernels.attention_cpu_h cimport paged_attention_c
from trillm.kernels.cache import row_width
from trillm.kernels.ops_cpu_h cimport (
    act_and_mul_pooled, rms_norm_f32, rms_norm_pooled, rotary_embedding_pooled, write_kv_pooled,
)
from trillm.kernels.quant_int8_cpu_h cimport int8_linear, int8_weight, int8_weights_of


cdef struct Projection:
    int8_weight w[4]  # INT8_MAX_PARTS
    int parts
    int64_t K
    int64_t N
    int isa


cdef struct Layer:
    const float *input_norm
    const float *post_norm  # the norm the MLP's input gets, with the residual added (Gemma's pre-feedforward)
    const float *attn_out_norm  # Gemma's norm of the attention's output, before the residual add; NULL: none
    const float *mlp_out_norm  # Gemma's norm of the MLP's output; NULL: none
    const float *q_norm  # NULL: none (then k_norm is none too)
    const float *k_norm
    bint gelu  # the MLP's activation: GeLU (tanh), else SiLU
    bint sliding_rope  # rotates by the second RoPE table (Gemma's sliding layers)
    Projection qkv
    Projection o
    Projection gate_up
    Projection down
    int64_t window  # 0: none
    void *k_cache
    void *v_cache


# What went wrong inside the nogil loop, raised once it is left.
cdef enum Failure:
    FAILED_NOT = 0
    FAILED_MEMORY = 1
    FAILED_POSITION = 2
    FAILED_SLOT = 3


cdef Projection _projection(linear) except *:
    """The kernel's arguments for one Int8QuantizedLinear (trillm/kernels/quant_cpu.pyx)."""
    cdef Projection p
    p.parts = int8_weights_of(linear, p.w)
    p.K = linear.in_features
    p.N = linear.out_features
    p.isa = linear.isa
    return p


cdef inline float *_address(t):
    return <float *><uintptr_t>t.data_ptr()


cdef inline int _linear(float *out, const float *x, int64_t M, const Projection *p, int64_t chunks) noexcept nogil:
    return int8_linear(out, x, M, p.K, p.N, p.w, p.parts, p.isa, pool_cpu.run, chunks)


cdef class DecoderStack:
    """The decoder layers of one loaded model, as pointers into its weights (it keeps those
    tensors alive). `run` takes the KV caches each call and keeps no hold on them: sleep mode
    frees them and makes new ones."""

    cdef Layer *layers
    cdef int64_t num_layers, hidden, q_size, kv_size, qkv_size, num_heads, num_kv_heads, head_dim, inter
    cdef float eps, post_eps, scale
    cdef object weights  # the tensors the pointers point into

    def __cinit__(self):
        self.layers = NULL

    def __init__(self, layers, float scale):
        """`layers`: per decoder layer, a dict: input_norm, post_norm (weights), eps, post_eps,
        attn_out_norm, mlp_out_norm (weights, or None; at post_eps), q_norm, k_norm (per-head
        weights, or None), qkv, o, gate_up, down (Int8QuantizedLinear), gelu (bool), sliding_rope
        (bool), num_heads, num_kv_heads, head_dim, window (None: none). Every layer has the same
        shapes."""
        cdef int64_t i
        first = layers[0]
        self.num_layers = len(layers)
        self.num_heads, self.num_kv_heads, self.head_dim = first["num_heads"], first["num_kv_heads"], first["head_dim"]
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_size = self.q_size + 2 * self.kv_size
        self.hidden = first["qkv"].in_features
        self.inter = first["down"].in_features
        self.eps, self.post_eps, self.scale = first["eps"], first["post_eps"], scale
        self.layers = <Layer *>malloc(self.num_layers * sizeof(Layer))
        if self.layers == NULL:
            raise MemoryError()
        self.weights = []
        for i, spec in enumerate(layers):
            assert (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]) == (self.num_heads, self.num_kv_heads,
                                                                                   self.head_dim)
            assert spec["eps"] == first["eps"] and spec["post_eps"] == first["post_eps"]
            assert (spec["qkv"].in_features, spec["qkv"].out_features) == (self.hidden, self.qkv_size)
            assert (spec["o"].in_features, spec["o"].out_features) == (self.q_size, self.hidden)
            assert (spec["gate_up"].in_features, spec["gate_up"].out_features) == (self.hidden, 2 * self.inter)
            assert (spec["down"].in_features, spec["down"].out_features) == (self.inter, self.hidden)
            for norm in (spec["input_norm"], spec["post_norm"], spec["attn_out_norm"], spec["mlp_out_norm"]):
                assert norm is None or (norm.dtype == torch.float32 and norm.is_contiguous()
                                        and norm.shape == (self.hidden,))
            self.layers[i].input_norm = _address(spec["input_norm"])
            self.layers[i].post_norm = _address(spec["post_norm"])
            self.layers[i].attn_out_norm = NULL if spec["attn_out_norm"] is None else _address(spec["attn_out_norm"])
            self.layers[i].mlp_out_norm = NULL if spec["mlp_out_norm"] is None else _address(spec["mlp_out_norm"])
            self.layers[i].gelu = spec["gelu"]
            self.layers[i].sliding_rope = spec["sliding_rope"]
            self.layers[i].q_norm = self.layers[i].k_norm = NULL
            if spec["q_norm"] is not None:
                for norm in (spec["q_norm"], spec["k_norm"]):
                    assert norm.dtype == torch.float32 and norm.is_contiguous() and norm.shape == (self.head_dim,)
                self.layers[i].q_norm = _address(spec["q_norm"])
                self.layers[i].k_norm = _address(spec["k_norm"])
            self.layers[i].qkv = _projection(spec["qkv"])
            self.layers[i].o = _projection(spec["o"])
            self.layers[i].gate_up = _projection(spec["gate_up"])
            self.layers[i].down = _projection(spec["down"])
            self.layers[i].window = spec["window"] or 0
            self.layers[i].k_cache = NULL
            self.layers[i].v_cache = NULL
            self.weights.append(spec)

    def __dealloc__(self):
        free(self.layers)

    def run(self, hidden, positions, slot_mapping, block_tables, seq_lens, kv_caches, cos_sin_cache,
            cos_sin_sliding=None):
        """hidden [T, hidden] fp32 (the embeddings of T decoding requests, one row each);
        positions, slot_mapping [T] int64; block_tables [T, max_blocks] int32; seq_lens [T] int32;
        kv_caches: per layer (K, V) [num_blocks, block_size, Hk, row_width], fp32, fp16 or int8
        (cache.py's layouts); cos_sin_cache [positions, head_dim] fp32, and cos_sin_sliding the
        sliding layers' where they have their own. Writes each
        layer's keys and values to the caches; returns (hidden, residual) after the last layer,
        as the layer-by-layer path hands them to the final norm."""
        cdef int64_t i, T = hidden.shape[0]
        assert hidden.dtype == torch.float32 and hidden.is_contiguous() and hidden.shape[1] == self.hidden
        sliding = cos_sin_cache if cos_sin_sliding is None else cos_sin_sliding
        for tensor, dtype in ((positions, torch.int64), (slot_mapping, torch.int64), (block_tables, torch.int32),
                              (seq_lens, torch.int32), (cos_sin_cache, torch.float32), (sliding, torch.float32)):
            assert tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.is_contiguous(), tensor.dtype
        assert positions.shape[0] == slot_mapping.shape[0] == block_tables.shape[0] == seq_lens.shape[0] == T
        assert cos_sin_cache.shape[1] == sliding.shape[1] == self.head_dim and len(kv_caches) == self.num_layers
        k0 = kv_caches[0][0]
        cdef int kind = cache_kind(k0, kv_caches[0][1])
        assert k0.shape[2:] == (self.num_kv_heads, row_width(self.head_dim, k0.dtype)), k0.shape
        # Read each call, and never kept: sleep mode frees the caches and makes new ones.
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            assert k_cache.dtype == v_cache.dtype == k0.dtype and k_cache.shape == v_cache.shape == k0.shape
            assert k_cache.is_contiguous() and v_cache.is_contiguous()
            self.layers[i].k_cache = <void *><uintptr_t>k_cache.data_ptr()
            self.layers[i].v_cache = <void *><uintptr_t>v_cache.data_ptr()
        cdef int64_t block_size = k0.shape[1], num_slots = k0.shape[0] * k0.shape[1]
        cdef int64_t max_blocks = block_tables.shape[1]
        cdef int64_t max_positions[2]
        max_positions[0], max_positions[1] = cos_sin_cache.shape[0], sliding.shape[0]
        # The step's buffers. residual ping-pongs between two: the norm's sum may not alias its input.
        f32 = torch.float32
        out_hidden = torch.empty(T, self.hidden, dtype=f32)
        residuals = (torch.empty(T, self.hidden, dtype=f32), torch.empty(T, self.hidden, dtype=f32))
        normed = torch.empty(T, self.hidden, dtype=f32)
        sandwiched = torch.empty(T, self.hidden, dtype=f32)  # Gemma's normed attention output
        qkv = torch.empty(T, self.qkv_size, dtype=f32)
        q = torch.empty(T, self.q_size, dtype=f32)
        k = torch.empty(T, self.kv_size, dtype=f32)  # normed keys, where the layers norm them
        attn = torch.empty(T, self.q_size, dtype=f32)
        projected = torch.empty(T, self.hidden, dtype=f32)
        gate_up = torch.empty(T, 2 * self.inter, dtype=f32)
        act = torch.empty(T, self.inter, dtype=f32)
        cdef float *x = _address(hidden)
        cdef float *res[2]
        res[0] = _address(residuals[0])
        res[1] = _address(residuals[1])
        cdef float *normed_p = _address(normed)
        cdef float *sandwiched_p = _address(sandwiched)
        cdef const float *to_add
        cdef float *qkv_p = _address(qkv)
        cdef float *q_p = _address(q)
        cdef float *k_p = _address(k)
        cdef float *keys
        cdef int64_t keys_stride
        cdef float *attn_p = _address(attn)
        cdef float *proj_p = _address(projected)
        cdef float *gate_up_p = _address(gate_up)
        cdef float *act_p = _address(act)
        cdef float *out_p = _address(out_hidden)
        cdef const int64_t *pos_p = <const int64_t *><uintptr_t>positions.data_ptr()
        cdef const int64_t *slots_p = <const int64_t *><uintptr_t>slot_mapping.data_ptr()
        cdef const int32_t *tables_p = <const int32_t *><uintptr_t>block_tables.data_ptr()
        cdef const int32_t *lens_p = <const int32_t *><uintptr_t>seq_lens.data_ptr()
        cdef const float *cos_sin[2]
        cos_sin[0], cos_sin[1] = _address(cos_sin_cache), _address(sliding)
        cdef int table
        cdef int64_t chunks = pool_cpu.chunks()
        cdef int64_t t, cur = 0
        cdef Failure failure = FAILED_NOT
        cdef Layer *layer
        cdef const float *layer_in = x
        with nogil:
            for i in range(self.num_layers):
                layer = &self.layers[i]
                # input norm: the first layer's residual is its input; later ones add the last output
                if i == 0:
                    rms_norm_pooled(pool_cpu.run, chunks, normed_p, NULL, layer_in, NULL, layer.input_norm, T,
                                    self.hidden, self.hidden, self.eps)
                    memcpy(res[cur], layer_in, T * self.hidden * sizeof(float))
                else:
                    rms_norm_pooled(pool_cpu.run, chunks, normed_p, res[1 - cur], layer_in, res[cur], layer.input_norm,
                                    T, self.hidden, self.hidden, self.eps)
                    cur = 1 - cur
                if _linear(qkv_p, normed_p, T, &layer.qkv, chunks) != 0:
                    failure = FAILED_MEMORY
                    break
                # the queries into q (normed per head where the layers norm them), the keys normed into k
                keys, keys_stride = qkv_p + self.q_size, self.qkv_size
                for t in range(T):
                    if layer.q_norm == NULL:
                        memcpy(q_p + t * self.q_size, qkv_p + t * self.qkv_size, self.q_size * sizeof(float))
                    else:
                        rms_norm_f32(q_p + t * self.q_size, NULL, qkv_p + t * self.qkv_size, NULL, layer.q_norm,
                                     self.num_heads, self.head_dim, self.head_dim, self.eps)
                        rms_norm_f32(k_p + t * self.kv_size, NULL, qkv_p + t * self.qkv_size + self.q_size, NULL,
                                     layer.k_norm, self.num_kv_heads, self.head_dim, self.head_dim, self.eps)
                if layer.q_norm != NULL:
                    keys, keys_stride = k_p, self.kv_size
                table = 1 if layer.sliding_rope else 0
                if (rotary_embedding_pooled(pool_cpu.run, chunks, q_p, pos_p, cos_sin[table], max_positions[table], T,
                                            self.num_heads, self.head_dim, self.q_size, 1) != 0
                        or rotary_embedding_pooled(pool_cpu.run, chunks, keys, pos_p, cos_sin[table],
                                                   max_positions[table], T, self.num_kv_heads, self.head_dim,
                                                   keys_stride, 1) != 0):
                    failure = FAILED_POSITION
                    break
                if write_kv_pooled(pool_cpu.run, chunks, layer.k_cache, layer.v_cache, kind, keys,
                                   qkv_p + self.q_size + self.kv_size, slots_p, T, num_slots, self.num_kv_heads,
                                   self.head_dim, keys_stride, self.qkv_size) != 0:
                    failure = FAILED_SLOT
                    break
                # every row its request's only query: a request with none or with more than its context is
                # impossible here, so a failure is the memory for the scores
                if paged_attention_c(attn_p, q_p, layer.k_cache, layer.v_cache, kind, tables_p, lens_p, NULL, T,
                                     self.num_heads, self.num_kv_heads, self.head_dim, block_size, max_blocks,
                                     self.scale, layer.window, 0, pool_cpu.run, chunks) != 0:
                    failure = FAILED_MEMORY
                    break
                if _linear(proj_p, attn_p, T, &layer.o, chunks) != 0:
                    failure = FAILED_MEMORY
                    break
                to_add = proj_p
                if layer.attn_out_norm != NULL:
                    rms_norm_pooled(pool_cpu.run, chunks, sandwiched_p, NULL, proj_p, NULL, layer.attn_out_norm, T,
                                    self.hidden, self.hidden, self.post_eps)
                    to_add = sandwiched_p
                rms_norm_pooled(pool_cpu.run, chunks, normed_p, res[1 - cur], to_add, res[cur], layer.post_norm, T,
                                self.hidden, self.hidden, self.post_eps)
                cur = 1 - cur
                if _linear(gate_up_p, normed_p, T, &layer.gate_up, chunks) != 0:
                    failure = FAILED_MEMORY
                    break
                act_and_mul_pooled(pool_cpu.run, chunks, act_p, gate_up_p, T, self.inter, layer.gelu)
                # the MLP's output, normed into out where the layers norm it (proj is free again by now)
                if _linear(proj_p if layer.mlp_out_norm != NULL else out_p, act_p, T, &layer.down, chunks) != 0:
                    failure = FAILED_MEMORY
                    break
                if layer.mlp_out_norm != NULL:
                    rms_norm_pooled(pool_cpu.run, chunks, out_p, NULL, proj_p, NULL, layer.mlp_out_norm, T,
                                    self.hidden, self.hidden, self.post_eps)
                layer_in = out_p
        if failure == FAILED_MEMORY:
            raise MemoryError("DecoderStack.run: no memory for a kernel's scratch")
        if failure == FAILED_POSITION:
            raise IndexError("rotary_embedding: a position is past the end of the cos/sin table")
        if failure == FAILED_SLOT:
            raise IndexError("write_kv: a slot is past the end of the cache")
        return out_hidden, residuals[cur]
