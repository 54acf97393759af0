"""LoRAConfig: what an adapter's adapter_config.json (PEFT's format) says about its arithmetic.

Only the keys that change what the adapter computes are read. A key whose non-default value changes the
arithmetic in a way this engine does not implement (DoRA, LoRA biases, per-module ranks, fan-in-fan-out
storage, extra trained modules) is an error naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

# PEFT module names radixserve applies adapters to (the projections of every decoder layer)
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_ADAPTER_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes; bound what we parse

# key -> the values that mean "off" (the only ones we accept)
_REFUSED_UNLESS_OFF: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
}

# Adapter names travel in URLs, model names and log lines: a plain identifier, never a path.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def check_adapter_name(name: str) -> str:
    """The one rule for adapter names: 1-64 letters, digits, '_', '-', '.', no '/' and no '..'."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise ValueError(f"LoRA adapter name {name!r} is invalid: use 1-64 letters, digits, '_', '-' or '.', "
                         "with no '/' and no '..'")
    return name


@dataclass(frozen=True)
class LoRAConfig:
    name: str  # the name requests use
    path: str  # the adapter folder
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # None: a regex in the file; the tensors present decide
    format: str = "peft"  # "peft" (a folder) or "gguf" (llama.cpp's adapter file, lora/gguf_adapter.py)

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_folder(cls, name: str, path: str, max_rank: int) -> LoRAConfig:
        check_adapter_name(name)
        where = f"LoRA adapter {name!r} ({path})"
        if not os.path.isdir(path):
            raise ValueError(f"{where}: no such folder (a PEFT adapter folder or a .gguf adapter file)")
        cfg_path = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{where}: adapter_config.json is missing")
        if os.path.getsize(cfg_path) > MAX_ADAPTER_CONFIG_BYTES:
            raise ValueError(f"{where}: adapter_config.json is larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: adapter_config.json must hold a JSON object")  # noqa: TRY004
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
        for key, off in _REFUSED_UNLESS_OFF.items():
            if raw.get(key) not in off:
                raise ValueError(f"{where}: adapter_config.json {key}={raw[key]!r} is not supported")
        r = raw.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"{where}: adapter_config.json r must be a positive integer, got {r!r}")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
        alpha = raw.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise ValueError(f"{where}: adapter_config.json lora_alpha must be a number, got {alpha!r}")
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            bad = [t for t in targets if t not in SUPPORTED_TARGETS]
            if bad or not targets:
                raise ValueError(f"{where}: target modules {bad or targets} are not in this model's projections "
                                 f"{list(SUPPORTED_TARGETS)}")
            target_tuple: tuple[str, ...] | None = tuple(targets)
        elif isinstance(targets, str):
            target_tuple = None
        else:
            raise ValueError(f"{where}: adapter_config.json target_modules must be a list or a regex "  # noqa: TRY004
                             "string")
        return cls(name=name, path=path, r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                   target_modules=target_tuple)


def parse_lora_paths(entries: tuple[str, ...] | list[str] | None) -> dict[str, str]:
    """--lora-paths entries `name=path` (or a bare path, named after its folder) -> {name: path}."""
    out: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            path, name = entry, os.path.basename(os.path.normpath(entry))
        check_adapter_name(name)
        if not path:
            raise ValueError(f"LoRA adapter {name!r}: empty path in {entry!r}")
        if name in out:
            raise ValueError(f"LoRA adapter name {name!r} is given twice")
        out[name] = path
    return out


class LoRANotFound(KeyError):
    """A request or call named an adapter that is not loaded (HTTP 404). Here, not in lora_manager.py: the
    HTTP process raises it and never imports torch."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"LoRA adapter {self.name!r} is not loaded"
