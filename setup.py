"""Builds the Cython extensions: the scheduler in trillm/sched_ext, a tokenizer's recovered merges
in trillm/model/merges.pyx, and the CPU kernels (decode
attention, quantized linears, the grouped LoRA multiply, the per-token ops, the sampler's draw, a decode step's whole layer
stack, their thread pool) in trillm/kernels; everything else is in pyproject.toml."""
from glob import glob

from Cython.Build import cythonize
from setuptools import Extension, setup

# -fopenmp-simd honours the kernel's `omp simd` loops (vectorized reductions) without OpenMP's runtime.
CPU_KERNEL_FLAGS = ["-O3", "-fopenmp-simd", "-Wno-psabi"]
# The kernels' headers include each other, which Cython does not follow: a change to any of them
# rebuilds every kernel, so no extension keeps a copy of an old one.
KERNEL_HEADERS = sorted(glob("trillm/kernels/*.h"))

setup(
    ext_modules=cythonize(
        [
            "trillm/sched_ext/*.pyx",
            "trillm/model/merges.pyx",
            *(Extension(f"trillm.kernels.{name}", [f"trillm/kernels/{name}.pyx"], extra_compile_args=CPU_KERNEL_FLAGS,
                        depends=KERNEL_HEADERS)
              for name in ("attention_cpu", "ops_cpu", "quant_cpu", "lora_cpu", "decoder_cpu", "sampling_cpu")),
            # -pthread: the helper threads of pool_cpu.h
            Extension("trillm.kernels.pool_cpu", ["trillm/kernels/pool_cpu.pyx"],
                      extra_compile_args=[*CPU_KERNEL_FLAGS, "-pthread"], extra_link_args=["-pthread"],
                      depends=KERNEL_HEADERS),
        ],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False},
    )
)
