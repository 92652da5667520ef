"""Compute kernels. Each op has a torch reference twin in `<op>.py` (used on CPU and
as the oracle in tests) and a Triton kernel with the same signature in `<op>_triton.py`
(used on CUDA). The twins never import triton, so the CPU path stays light."""
