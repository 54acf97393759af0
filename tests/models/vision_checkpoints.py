"""What the vision tests read back from a saved transformers model: its tensors by checkpoint name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def saved_tensors(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """save_pretrained `model` to `path`, then every tensor of the written safetensors files."""
    model.save_pretrained(path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def sub(tensors: dict[str, torch.Tensor], prefix: str, new_prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors under `prefix`, renamed to start with `new_prefix` instead."""
    return [(new_prefix + k[len(prefix) :], v) for k, v in tensors.items() if k.startswith(prefix)]
