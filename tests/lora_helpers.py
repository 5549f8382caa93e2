"""LoRA adapters for the tests, made and saved by PEFT itself (`save_pretrained`), and PEFT's own answer for
them (`merge_and_unload`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_random_adapter(base: Any, path: Path, *, seed: int, **lora: Any) -> Path:
    """PEFT's random adapter (`init_lora_weights=False`: A and B both drawn, so it changes the output) on
    the transformers model `base`, saved to `path`. `lora`: LoraConfig fields (r, lora_alpha, target_modules,
    use_rslora...)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(path)
    model.unload()  # the base's modules back as they were, for the next adapter
    return path


def merged_greedy(
    base_path: str, adapter: Path | None, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens after each prompt, on the base merged with `adapter` by PEFT
    (`merge_and_unload`), or on the base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs
