"""Random PEFT adapters for the LoRA tests: made with peft itself, with a non-zero B (peft initialises B to
zero, which would make every adapter the base model)."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, out_dir: str, seed: int, r: int = 8, alpha: float = 16.0,
                 targets: list[str] | None = None, use_rslora: bool = False, std: float = 0.05) -> str:
    """Save a peft LoRA adapter of `base_model` (a transformers model, left unchanged) to out_dir."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base_model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(out_dir)
    peft_model.unload()  # the base model's modules back, without the LoRA layers
    return out_dir


def peft_reference(base_model, adapter_dir: str):
    """transformers + peft with the adapter applied: the oracle (on a copy: base_model stays the base)."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir)
    model.eval()
    return model
