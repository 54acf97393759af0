"""llama.cpp's GGUF LoRA adapters (what convert_lora_to_gguf.py writes), read with the `gguf` package.

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha = <float>, general.architecture
    tensors  blk.<i>.<stem>.weight.lora_a   [r, in]   (ggml ne = [in, r]; PyTorch order as PEFT's lora_A)
             blk.<i>.<stem>.weight.lora_b   [out, r]  (as PEFT's lora_B)

Names go back to Hugging Face module paths through the architecture's record (model_loader/gguf_arch.py),
the same table the base-model loader uses. convert_hf_to_gguf permutes the q/k rows of Llama-family
weights for llama.cpp's RoPE, and convert_lora_to_gguf applies that permutation to lora_b (the output
rows): it is undone here as it is for the base weights. The scale is llama.cpp's: alpha / r.
"""

from __future__ import annotations

import math

import torch

from radixserve.lora.lora_config import LoRAConfig
from radixserve.model_loader.gguf_arch import GGUF_ARCHITECTURES
from radixserve.model_loader.gguf_file import open_gguf
from radixserve.model_loader.gguf_names import hf_parameter_name, permuted_head_count, unpermute_rows

_SUFFIXES = (".lora_a", ".lora_b")


def gguf_lora_config(name: str, path: str, max_rank: int) -> LoRAConfig:
    where = f"LoRA adapter {name!r} ({path})"
    try:
        f = open_gguf(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    kind = f.get("general.type", None)
    if kind != "adapter" or f.get("adapter.type", None) != "lora":
        raise ValueError(f"{where}: not a GGUF LoRA adapter (general.type {kind!r}, adapter.type "
                         f"{f.get('adapter.type', None)!r}; expected 'adapter' and 'lora')")
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: architecture {arch!r} is not supported (known: {sorted(GGUF_ARCHITECTURES)})")
    ranks = {int(f.hf_shape(n)[0]) for n in f.tensors if n.endswith(".lora_a")}
    if len(ranks) != 1:
        raise ValueError(f"{where}: its lora_a tensors must share one rank, found {sorted(ranks) or 'none'}")
    r = ranks.pop()
    if r > max_rank:
        raise ValueError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
    alpha = f.get("adapter.lora.alpha", None)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        alpha = float(r)  # llama.cpp: no alpha means scale 1
    return LoRAConfig(name=name, path=path, r=r, lora_alpha=float(alpha), use_rslora=False, target_modules=None,
                      format="gguf")


def read_gguf_pairs(config: LoRAConfig, num_heads: int, num_kv_heads: int) -> dict[str, dict[str, torch.Tensor]]:
    """HF module path -> {"lora_A", "lora_B"} (PyTorch order, HF row layout)."""
    where = f"LoRA adapter {config.name!r}"
    try:
        f = open_gguf(config.path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    record = GGUF_ARCHITECTURES[f.architecture]
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for gguf_name in f.tensors:
        suffix = next((s for s in _SUFFIXES if gguf_name.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{where}: tensor {gguf_name!r} is not a .lora_a / .lora_b tensor (not supported)")
        base = gguf_name[: -len(suffix)]
        try:
            hf_name = hf_parameter_name(base, record.block_names)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if hf_name is None or not hf_name.endswith(".weight"):
            raise ValueError(f"{where}: tensor {gguf_name!r} targets no projection weight")
        try:
            t = torch.from_numpy(f.dequantize(gguf_name))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if t.dim() != 2:
            raise ValueError(f"{where}: tensor {gguf_name!r} has shape {tuple(t.shape)}; a LoRA factor is 2-D")
        heads = permuted_head_count(base, num_heads, num_kv_heads) if record.permuted_qk else None
        if suffix == ".lora_b" and heads is not None:
            try:
                t = unpermute_rows(t, heads)
            except ValueError as e:
                raise ValueError(f"{where}: tensor {gguf_name!r}: {e}") from None
        pairs.setdefault(hf_name.removesuffix(".weight"), {})["lora_A" if suffix == ".lora_a" else "lora_B"] = t
    return pairs
