"""LoRAAdapter: one adapter's weights, laid out on radixserve's own (stacked) projections.

PEFT stores, per targeted Hugging Face module, lora_A [r, in] and lora_B [out, r]; the module computes
`base(x) + scaling * B(A x)`. radixserve stacks q/k/v into qkv_proj and gate/up into gate_up_proj
(CausalLM.stacked_params), so an adapter's pieces for one stacked projection become one pair:

    A = [A_q; A_k; A_v]            [sum of ranks, in]      (only the shards the adapter targets)
    B = block diagonal             [out of qkv_proj, sum of ranks]
        rows of q  <- B_q in the columns of A_q's rows, and so on; zero elsewhere

so one `x @ A.T @ B.T` per projection gives every shard's delta in its own rows. The scaling is
folded into B once at load time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from radixserve.layers.linear import PackableLinear, RowParallelLinear
from radixserve.lora.gguf_adapter import gguf_lora_config, read_gguf_pairs
from radixserve.lora.lora_config import SUPPORTED_TARGETS, LoRAConfig, check_adapter_name

ADAPTER_FILE = "adapter_model.safetensors"
_PREFIXES = ("base_model.model.",)  # what PEFT puts before the base model's own module path


@dataclass
class LoRAWeights:
    """The delta of one of our projections: out += (x @ A.T) @ B.T (scaling already in B)."""

    A: torch.Tensor  # [rank_sum, in_features] (this rank's)
    B: torch.Tensor  # [out_features, rank_sum] (this rank's)
    # row-parallel under TP: x @ A.T is a partial sum over this rank's input features; it is all-reduced
    # (a [rows, rank] tensor, small) before B, and the delta is added after the layer's own all-reduce
    reduce: bool = False
    # [S, 4] int64 (out start, out rows, rank start, ranks): the non-zero blocks of B, one per stacked shard
    # (None: B is one block, every output row over every rank)
    blocks: torch.Tensor | None = None

    _views: list[tuple[int, int, int, int, torch.Tensor]] | None = field(default=None, repr=False, compare=False)

    def block_table(self) -> torch.Tensor:
        if self.blocks is None:
            return torch.tensor([[0, self.B.shape[0], 0, self.A.shape[0]]], dtype=torch.int64)
        return self.blocks

    def block_views(self) -> list[tuple[int, int, int, int, torch.Tensor]]:
        """(out start, out rows, rank start, ranks, B's block as a view) for each non-zero block of B."""
        if self._views is None:
            self._views = [(o0, on, r0, rn, self.B[o0 : o0 + on, r0 : r0 + rn])
                           for o0, on, r0, rn in self.block_table().tolist()]
        return self._views


@dataclass
class LoRAAdapter:
    config: LoRAConfig
    uid: int  # never reused: the radix cache namespace of this load of the adapter
    weights: dict[str, LoRAWeights]  # our module name (model.layers.0.self_attn.qkv_proj) -> delta

    @property
    def name(self) -> str:
        return self.config.name

    def nbytes(self) -> int:
        return sum(w.A.numel() * w.A.element_size() + w.B.numel() * w.B.element_size() for w in self.weights.values())


def lora_target_modules(model: nn.Module) -> dict[str, PackableLinear]:
    """Our projections an adapter may target, by module name."""
    ours = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    return {n: m for n, m in model.named_modules() if isinstance(m, PackableLinear) and n.rsplit(".", 1)[-1] in ours}


def _our_module(model: nn.Module, hf_module: str) -> tuple[str, object]:
    """HF module path -> (our module name, shard id) through the model's own stacking table."""
    dotted = hf_module + "."
    for ckpt, ours, sid in getattr(model, "stacked_params", []):
        if ckpt in dotted:
            return dotted.replace(ckpt, ours)[:-1], sid
    return hf_module, None


def _read_tensors(config: LoRAConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    where = f"LoRA adapter {config.name!r}"
    path = os.path.join(config.path, ADAPTER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{where}: {ADAPTER_FILE} is missing in {config.path}")
    try:
        out = {}
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[key] = f.get_tensor(key)
        return out
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{where}: {ADAPTER_FILE} is unreadable (truncated or corrupt): {e}") from None


def load_adapter(config: LoRAConfig, model: nn.Module, uid: int, dtype: torch.dtype,
                 device: torch.device, ps: Any = None) -> LoRAAdapter:
    """Read and check an adapter against `model`; every error names the adapter (and the tensor)."""
    if config.format == "gguf":

        cfg = model.config  # the q/k rows of llama-family files are permuted per head (gguf_adapter.py)
        pairs = read_gguf_pairs(config, cfg.num_attention_heads, cfg.num_key_value_heads)
    else:
        pairs = _peft_pairs(config)
    rename = getattr(model, "checkpoint_name", None)
    if rename is not None:  # a vision-language model: its decoder's checkpoint paths (language_model...) map onto ours
        pairs = {rename(name): ab for name, ab in pairs.items()}
    return build_adapter(config, pairs, model, uid, dtype, device, ps)


def _peft_pairs(config: LoRAConfig) -> dict[str, dict[str, torch.Tensor]]:
    """HF module path -> {"lora_A": [r, in], "lora_B": [out, r]} from a PEFT adapter_model.safetensors."""
    where = f"LoRA adapter {config.name!r}"
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(config).items():
        name = key
        for p in _PREFIXES:
            name = name.removeprefix(p)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name and name.endswith(".weight"):
                pairs.setdefault(name.split(marker)[0], {})[part] = t
                break
        else:
            raise ValueError(f"{where}: tensor {key!r} is not a lora_A / lora_B weight (not supported)")
    return pairs


def build_adapter(config: LoRAConfig, pairs: dict[str, dict[str, torch.Tensor]], model: nn.Module, uid: int,
                  dtype: torch.dtype, device: torch.device, ps: Any = None) -> LoRAAdapter:
    """Check every (A, B) pair against the model's projection it targets and lay them out on ours,
    this rank's slices only (A and B are cut like their layer: see _rank_slice)."""
    where = f"LoRA adapter {config.name!r}"
    if not pairs:
        raise ValueError(f"{where}: the adapter holds no LoRA tensors")
    targets = lora_target_modules(model)
    tp = 1 if ps is None else ps.tp_size
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # our module -> [(dst row, A, B)]
    for hf_module, ab in sorted(pairs.items()):
        short = hf_module.rsplit(".", 1)[-1]
        if short not in SUPPORTED_TARGETS or (config.target_modules and short not in config.target_modules):
            raise ValueError(f"{where}: target module {hf_module!r} is not one this model's adapters may target "
                             f"({list(config.target_modules or SUPPORTED_TARGETS)})")
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: {hf_module} has {sorted(ab)} but needs both lora_A and lora_B")
        ours, sid = _our_module(model, hf_module)
        module = targets.get(ours)
        if module is None:
            raise ValueError(f"{where}: target module {hf_module!r} does not exist in this model")
        dim, start, length, dst = module.tp_slice(sid)
        out_f, in_f = module.weight_dims()
        replicas = getattr(module, "kv_replicas", 1) if sid in ("k", "v") else 1
        full = length * tp // replicas  # the checkpoint size of the sharded dimension
        want_a, want_b = ((config.r, in_f), (full, config.r)) if dim == 0 else ((config.r, full), (out_f, config.r))
        a, b = ab["lora_A"], ab["lora_B"]
        for tname, t, want in ((f"{hf_module}.lora_A.weight", a, want_a), (f"{hf_module}.lora_B.weight", b, want_b)):
            if not t.is_floating_point():
                raise ValueError(f"{where}: tensor {tname} has dtype {t.dtype}, expected a float type")
            if tuple(t.shape) != want:
                raise ValueError(f"{where}: tensor {tname} has shape {tuple(t.shape)}, but the base model needs "
                                 f"{want} (rank {config.r})")
            if not torch.isfinite(t).all():
                raise ValueError(f"{where}: tensor {tname} holds NaN or Inf")
        # this rank's part: column-parallel cuts B's rows (its output shard), row-parallel A's columns
        if dim == 0:
            b = b.narrow(0, start, length)
        else:
            a = a.narrow(1, start, length)
        pieces.setdefault(ours, []).append((dst, a.to(torch.float32), b.to(torch.float32)))
    weights = {}
    for ours, module_pieces in pieces.items():
        module = targets[ours]
        reduce = tp > 1 and isinstance(module, RowParallelLinear)
        weights[ours] = stack_shards(module_pieces, module.weight_dims()[0], config.scaling, dtype, device, reduce)
    return LoRAAdapter(config, uid, weights)


def stack_shards(pieces: list[tuple[int, torch.Tensor, torch.Tensor]], out_f: int, scaling: float,
                 dtype: torch.dtype, device: torch.device, reduce: bool = False) -> LoRAWeights:
    """One projection's weights from its shards' (first output row, A [r, in], B [rows, r]) pieces: A stacked,
    B block diagonal over the shards (scaling folded in), and the block table lora_sgmv reads."""
    rank_sum = sum(a.shape[0] for _, a, _ in pieces)
    B = torch.zeros(out_f, rank_sum)  # [out, sum of ranks]: block diagonal over the stacked shards
    col, blocks = 0, []
    for dst, a, b in pieces:
        B[dst : dst + b.shape[0], col : col + a.shape[0]] = b * scaling
        blocks.append([dst, b.shape[0], col, a.shape[0]])
        col += a.shape[0]
    A = torch.cat([a for _, a, _ in pieces], dim=0)  # [sum of ranks, in]
    return LoRAWeights(A.to(device=device, dtype=dtype).contiguous(), B.to(device=device, dtype=dtype).contiguous(),
                       reduce, torch.tensor(blocks, dtype=torch.int64))


def read_lora_config(name: str, path: str, max_rank: int) -> LoRAConfig:
    """A PEFT folder, or a llama.cpp GGUF adapter file (*.gguf)."""
    check_adapter_name(name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_lora_config(name, path, max_rank)
    return LoRAConfig.from_folder(name, path, max_rank)
