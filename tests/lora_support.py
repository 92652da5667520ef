"""LoRA adapters for tests (a module, not a test file): random PEFT adapters made by `peft` on
a base model directory, and what transformers + peft make of them, merged."""
from __future__ import annotations

import functools
import tempfile

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@functools.cache
def make_adapter(base_dir: str, seed: int = 0, rank: int = 4, alpha: int = 8, modules: tuple = tuple(ALL_MODULES),
                 **extra) -> str:
    """A random LoRA adapter (A and B both random: peft's init_lora_weights=False) for the model at
    `base_dir`, saved by peft as a PEFT directory; the same arguments give the same directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False, **extra)
    model = get_peft_model(base, config)
    with torch.no_grad():  # larger than peft's init, so an adapter changes greedy choices
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)
    path = tempfile.mkdtemp(prefix=f"lora-{seed}-")
    model.save_pretrained(path)
    return path


@functools.cache
def merged_model(base_dir: str, adapter_dir: str | None):
    """transformers' model with the adapter merged into its weights (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def reference(base_dir: str, adapter_dir: str | None, prompt: list[int], num_tokens: int):
    """transformers + peft (merged): the greedy continuation, and each generated token's logprob."""
    model = merged_model(base_dir, adapter_dir)
    with torch.inference_mode():
        full = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                              pad_token_id=0)[0].tolist()
        logprobs = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
    tokens = full[len(prompt):]
    return tokens, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]

