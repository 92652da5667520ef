"""Builds the Cython extensions: the scheduler in trillm/sched_ext and the CPU kernels (decode
attention, quantized linears, the grouped LoRA multiply, the per-token ops, a decode step's whole layer
stack, their thread pool) in trillm/kernels; everything else is in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

# -fopenmp-simd honours the kernel's `omp simd` loops (vectorized reductions) without OpenMP's runtime.
CPU_KERNEL_FLAGS = ["-O3", "-fopenmp-simd", "-Wno-psabi"]
# Included by attention_cpu.h, which Cython does not read: a change to it rebuilds its users.
ATTENTION_HEADERS = ["trillm/kernels/attention_tile_cpu.h"]

setup(
    ext_modules=cythonize(
        [
            "trillm/sched_ext/*.pyx",
            Extension("trillm.kernels.attention_cpu", ["trillm/kernels/attention_cpu.pyx"],
                      extra_compile_args=CPU_KERNEL_FLAGS, depends=ATTENTION_HEADERS),
            Extension("trillm.kernels.ops_cpu", ["trillm/kernels/ops_cpu.pyx"], extra_compile_args=CPU_KERNEL_FLAGS),
            Extension("trillm.kernels.quant_cpu", ["trillm/kernels/quant_cpu.pyx"], extra_compile_args=CPU_KERNEL_FLAGS),
            Extension("trillm.kernels.lora_cpu", ["trillm/kernels/lora_cpu.pyx"], extra_compile_args=CPU_KERNEL_FLAGS),
            Extension("trillm.kernels.decoder_cpu", ["trillm/kernels/decoder_cpu.pyx"],
                      extra_compile_args=CPU_KERNEL_FLAGS, depends=ATTENTION_HEADERS),
            # -pthread: the helper threads of pool_cpu.h
            Extension("trillm.kernels.pool_cpu", ["trillm/kernels/pool_cpu.pyx"],
                      extra_compile_args=[*CPU_KERNEL_FLAGS, "-pthread"], extra_link_args=["-pthread"]),
        ],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False},
    )
)
