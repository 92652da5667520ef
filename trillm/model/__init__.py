"""The model side: weights loaded from GGUF or HF directories, the Llama-family forward on the
paged KV cache, LoRA adapters, tensor-parallel ranks, CUDA graphs, and the runner that turns a
scheduled step into logits. It imports `kernels`, `config` and `sched_ext`, never `engine` or
`http`: the engine drives it through `ModelRunner` alone."""
