"""Test-wide settings, applied before any test module imports a kernel.

On a machine without CUDA, Triton kernels run in the interpreter, which reads
TRITON_INTERPRET when a kernel is decorated: it must be set before any
`trillm.kernels.*_triton` import. One torch thread keeps step times stable on
small machines.
"""
import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
