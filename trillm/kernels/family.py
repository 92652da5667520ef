"""The kernel family a model runs on: norms, activation, rotary, the KV write, attention and,
where it has them, its own linears. A family is the torch reference twins, those twins with the
CPU's compiled kernels where a CPU step spends its time, or the Triton kernels. One name
(`EngineArgs.attention_backend`, the `--attention-backend` flag) switches all of them, so a model
never mixes a Triton attention with a torch norm by accident, and the model code stays the same
on every device.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from trillm.config import AttentionBackend, KVCacheDType
from trillm.kernels.attention import attend_planned, plan_attention

if TYPE_CHECKING:
    from trillm.kernels.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)


class Kernels:
    """The kernels a model calls, all from `trillm.kernels.<op><module_suffix>`.

    The twins share signatures, so a family is only a choice of modules. Subclasses name it;
    the import happens at construction, so the CPU path never loads triton. `dtype` is the
    model's, which its KV cache shares: a family whose kernels run only some dtypes picks them
    there, once.
    """

    name: str
    module_suffix: str
    packs_linear_weights = False  # the runner calls loader.pack_linear_weights(model) once loaded
    # a class that runs a decode step through every decoder layer in one call (DecoderStack in
    # trillm/kernels/decoder_cpu.pyx), for a model whose projections all run on this family's
    # quantized_linear; None: the layers run one by one
    decoder_stack = None
    # for GGUF-quantized projections (trillm/kernels/quant.py): a class made from a QuantizedWeight,
    # called as (x, bias) -> y, whose runs(weight) says which it takes; None: dense weights only
    quantized_linear = None

    def __init__(self, dtype: torch.dtype, quantized_activations: bool = True,
                 kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO):
        """`quantized_activations`: whether a family with a quantized_linear runs it on 8-bit
        activations (EngineArgs.quantized_activations); the others ignore it. `kv_cache_dtype`
        (EngineArgs.kv_cache_dtype) becomes self.kv_cache_dtype, "auto" the family's choice."""
        self.kv_cache_dtype = self.cache_dtype(dtype, kv_cache_dtype)

        def kernels(op: str):
            return importlib.import_module(f"trillm.kernels.{op}{self.module_suffix}")

        norm = kernels("norm")
        self.rms_norm = norm.rms_norm
        self.fused_add_rms_norm = norm.fused_add_rms_norm
        self.silu_and_mul = kernels("activation").silu_and_mul
        self.gelu_tanh_and_mul = kernels("activation").gelu_tanh_and_mul
        self.rotary_embedding = kernels("rotary").rotary_embedding
        self.write_kv = kernels("cache").write_kv
        self.paged_attention = kernels("attention").paged_attention
        self.lora_add = kernels("lora").lora_add  # each row's LoRA adapter update (trillm/model/lora.py)

    @classmethod
    def cache_dtype(cls, dtype: torch.dtype, kv_cache_dtype: KVCacheDType) -> torch.dtype:
        """The KV cache's dtype for a model in `dtype` asked for `kv_cache_dtype`."""
        return KV_CACHE_DTYPES[kv_cache_dtype] or cls.auto_kv_cache_dtype(dtype)

    @staticmethod
    def auto_kv_cache_dtype(dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model in `dtype` when none is asked for."""
        return dtype

    def describe(self) -> str:
        """What the start-up log adds about this family (its instruction sets), from ", " on."""
        return ""

    def set_threads(self, threads: int) -> int:
        """Threads the family's own compiled kernels use (EngineArgs.kernel_threads); returns the
        number in effect. Families without a thread pool run on the caller's thread."""
        return 1

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Writes this step's k, v [T, Hk, D] to the cache, then attends q [T, H, D] to the
        whole context of each request. Returns [T, H, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, sliding_window
        )


class TorchKernels(Kernels):
    name = "torch"
    module_suffix = ""
    row_kernel = None  # query rows go through the gather and SDPA (attention.plan_attention)

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        """As Kernels.attend, with the slots and masks planned once per step, not per layer."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        key = ("torch_attention_plan", sliding_window)
        plan = meta.per_step.get(key)
        if plan is None:
            plan = meta.per_step[key] = plan_attention(
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                k_cache.shape[1],
                sliding_window,
                self.row_kernel,
            )
        return attend_planned(q, k_cache, v_cache, plan, scale)


class CpuKernels(TorchKernels):
    """The torch twins, sped up where a CPU step spends its time: projections on oneDNN's packed
    weights (trillm/kernels/linear_cpu.py) or, for a GGUF model, on its quantized blocks
    (trillm/kernels/quant_cpu.pyx); attention by the compiled kernel (trillm/kernels/attention_cpu.pyx), which reads the
    paged cache without a gather and computes each query row the same whatever else the step
    holds; norms,
    SiLU- and GeLU-and-mul, rotary and the KV write each one compiled pass (trillm/kernels/ops_cpu.pyx); the
    grouped LoRA multiply, row by row (trillm/kernels/lora_cpu.pyx).
    fp32 only for the compiled kernels; other dtypes keep packed weights and the twins. The
    quantized projections multiply 8-bit activations in integers (quant_int8_cpu.h) unless
    `quantized_activations` is off; they and attention share their work among
    `set_threads` threads. An fp32 model keeps its KV cache in fp16 unless told otherwise (int8,
    with a scale per token and head, on request: trillm/kernels/cache.py)."""

    name = "cpu"
    packs_linear_weights = True

    def __init__(self, dtype: torch.dtype, quantized_activations: bool = True,
                 kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO):
        super().__init__(dtype, quantized_activations, kv_cache_dtype)
        from trillm.kernels import lora_cpu, ops_cpu, quant_cpu
        from trillm.kernels.attention_cpu import CACHE_DTYPES, paged_attention

        if dtype == torch.float32:
            if self.kv_cache_dtype in CACHE_DTYPES:  # fp32, fp16 or int8; a bf16 cache keeps the twins
                self.row_kernel = paged_attention
                self.write_kv = ops_cpu.write_kv
                if quantized_activations:
                    from trillm.kernels.decoder_cpu import DecoderStack

                    self.decoder_stack = DecoderStack
            self.quantized_linear = quant_cpu.Int8QuantizedLinear if quantized_activations else quant_cpu.QuantizedLinear
            self.rms_norm = ops_cpu.rms_norm
            self.fused_add_rms_norm = ops_cpu.fused_add_rms_norm
            self.silu_and_mul = ops_cpu.silu_and_mul
            self.gelu_tanh_and_mul = ops_cpu.gelu_tanh_and_mul
            self.rotary_embedding = ops_cpu.rotary_embedding
            self.lora_add = lora_cpu.lora_add

    @staticmethod
    def auto_kv_cache_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype == torch.float32 else dtype

    def describe(self) -> str:
        from trillm.kernels import quant_cpu

        if self.quantized_linear is None:
            return ", compiled kernels off for this dtype (torch twins)"
        if self.quantized_linear is quant_cpu.Int8QuantizedLinear:
            refused = " (the CPU's AMX tiles refused by Linux)" if quant_cpu.amx_refused() else ""
            return f", GGUF blocks as 8-bit integer dot products on {quant_cpu.isas()[-1]}{refused}"
        return ", GGUF blocks with fp32 activations"

    def set_threads(self, threads: int) -> int:
        from trillm.kernels import pool_cpu

        return pool_cpu.set_threads(threads)


class TritonKernels(Kernels):
    name = "triton"
    module_suffix = "_triton"

    def __init__(self, dtype: torch.dtype, quantized_activations: bool = True,
                 kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO):
        super().__init__(dtype, quantized_activations, kv_cache_dtype)
        if self.kv_cache_dtype not in (dtype, torch.int8):
            raise ValueError(f"The triton kernels keep the KV cache in the model's dtype ({dtype}) or in int8; "
                             f"--kv-cache-dtype {kv_cache_dtype} is for the torch and cpu families.")


FAMILIES = {AttentionBackend(cls.name): cls for cls in (TorchKernels, CpuKernels, TritonKernels)}
KV_CACHE_DTYPES = {KVCacheDType.AUTO: None, KVCacheDType.FLOAT32: torch.float32, KVCacheDType.FLOAT16: torch.float16,
                   KVCacheDType.BFLOAT16: torch.bfloat16, KVCacheDType.INT8: torch.int8}


def get_kernels(
    name: AttentionBackend, device: torch.device, dtype: torch.dtype, quantized_activations: bool = True,
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO,
) -> Kernels:
    """The family `name` (EngineArgs.attention_backend) means (family_of), made;
    `quantized_activations` and `kv_cache_dtype` go to it (Kernels.__init__)."""
    family = family_of(name, device, dtype)
    if name == AttentionBackend.AUTO and device.type == "cpu" and family is not CpuKernels:
        log.warning("the compiled CPU kernels are not built, or do not run %s here: every op runs on the "
                    "torch reference kernels, several times slower (build them: setup.py build_ext)", dtype)
    kernels = family(dtype, quantized_activations, kv_cache_dtype)
    log.info("kernels: the %s family on %s, %s weights, %s KV cache%s", family.name, device.type,
             str(dtype).removeprefix("torch."), str(kernels.kv_cache_dtype).removeprefix("torch."),
             kernels.describe())
    return kernels


def family_of(name: AttentionBackend, device: torch.device, dtype: torch.dtype) -> type[Kernels]:
    """The family `name` means: "auto" is Triton on CUDA, and on CPU the cpu family where its
    compiled kernels are built and oneDNN runs the dtype, else the torch twins. ValueError for
    the cpu family where it does not run."""
    cpu_runs = device.type == "cpu" and _cpu_family_runs(dtype)
    if name == AttentionBackend.AUTO:
        name = (AttentionBackend.TRITON if device.type == "cuda" else
                AttentionBackend.CPU if cpu_runs else AttentionBackend.TORCH)
    if name == AttentionBackend.CPU and not cpu_runs:
        raise ValueError("The cpu kernel family runs on the CPU, in float32 or (with AVX512-bf16) bfloat16, once built.")
    return FAMILIES[name]


def kv_cache_dtype_of(name: AttentionBackend, device: torch.device, dtype: torch.dtype,
                      kv_cache_dtype: KVCacheDType) -> torch.dtype:
    """The dtype of the KV cache get_kernels' family keeps, without making the family."""
    return family_of(name, device, dtype).cache_dtype(dtype, kv_cache_dtype)


def _cpu_family_runs(dtype: torch.dtype) -> bool:
    from trillm.kernels import linear_cpu

    built = all(importlib.util.find_spec(f"trillm.kernels.{ext}") for ext in ("attention_cpu", "lora_cpu", "ops_cpu", "pool_cpu", "quant_cpu"))
    return built and linear_cpu.is_available(dtype)
