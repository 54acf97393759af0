"""LoRAManager: the adapters a runner knows, the ones held in memory (an LRU), and who is using them.

    registered (name -> config, uid)     every adapter requests may name (--lora-paths, or loaded later)
    loaded     (LRU, <= max_loaded)      weights in memory; an adapter a running request uses is pinned
    pins       (name -> requests)        a pinned adapter is never evicted

The uid is given at registration and never reused: it is the adapter's namespace in the radix cache, so
a prefix computed under one adapter is never served to another, nor to a later adapter of the same name.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch

from radixserve.lora.lora_adapter import LoRAAdapter, load_adapter
from radixserve.lora.lora_batch import LoRABatch, install_lora_hooks, torch_lora_apply
from radixserve.lora.lora_config import LoRAConfig

logger = logging.getLogger(__name__)


class LoRANotFound(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"LoRA adapter {self.name!r} is not loaded"


def parse_lora_paths(entries: tuple[str, ...] | list[str] | None) -> dict[str, str]:
    """--lora-paths entries `name=path` (or a bare path, named after its folder) -> {name: path}."""
    import os

    out: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            path, name = entry, os.path.basename(os.path.normpath(entry))
        if name in out:
            raise ValueError(f"ServerArgs.lora_paths: adapter name {name!r} is given twice")
        out[name] = path
    return out


class LoRAManager:
    def __init__(self, model: nn.Module, paths: dict[str, str], max_rank: int, max_loaded: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.dtype, self.device = dtype, device
        self._uids = itertools.count(1)  # 0 is the base model's namespace
        self.registered: dict[str, tuple[LoRAConfig, int]] = {}
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.pins: dict[str, int] = {}
        install_lora_hooks(model)
        for name, path in paths.items():
            self.register(name, path)  # every adapter is read and checked at start-up

    # ------------------------------------------------------------------ registry
    def names(self) -> list[str]:
        return list(self.registered)

    def uid(self, name: str) -> int:
        if name not in self.registered:
            raise LoRANotFound(name)
        return self.registered[name][1]

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Read, check and load adapter `name` (a ValueError naming it on any problem)."""
        if name in self.registered:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        config = LoRAConfig.from_folder(name, path, self.max_rank)
        uid = next(self._uids)
        adapter = load_adapter(config, self.model, uid, self.dtype, self.device)
        self.registered[name] = (config, uid)
        self._insert(adapter)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections, %.1f MB)", name, path, config.r,
                    len(adapter.weights), adapter.nbytes() / 2**20)
        return adapter

    def unregister(self, name: str) -> None:
        """New requests for `name` are refused from now on; its weights go when no request uses them."""
        if name not in self.registered:
            raise LoRANotFound(name)
        del self.registered[name]
        if not self.pins.get(name):
            self.loaded.pop(name, None)

    # ------------------------------------------------------------------ use
    def can_pin(self, name: str) -> bool:
        """Whether `name` is in memory or can be brought in without evicting a pinned adapter."""
        return name in self.loaded or len(self.loaded) < self.max_loaded or any(
            not self.pins.get(n) for n in self.loaded)

    def pin(self, name: str) -> LoRAAdapter:
        """The adapter a request admitted now will use, loaded if needed; held until unpin."""
        adapter = self.loaded.get(name)
        if adapter is None:
            config, uid = self.registered[name]
            adapter = load_adapter(config, self.model, uid, self.dtype, self.device)
            self._insert(adapter)
        self.loaded.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return adapter

    def unpin(self, name: str) -> None:
        self.pins[name] -= 1
        if self.pins[name] == 0:
            del self.pins[name]
            if name not in self.registered:  # unloaded while in use: its last request is done
                self.loaded.pop(name, None)

    def adapter(self, name: str) -> LoRAAdapter:
        """A pinned adapter's weights (what a step's rows use)."""
        return self.loaded[name]

    def _insert(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        while len(self.loaded) > self.max_loaded:
            victim = next((n for n in self.loaded if not self.pins.get(n) and n != adapter.name), None)
            if victim is None:
                break  # every other adapter is pinned: can_pin() kept this from happening at admission
            del self.loaded[victim]

    def batch_for(self, fb: ForwardBatch) -> LoRABatch | None:
        """The step's adapter groups (None for a base-only step: the hooks then cost one check each)."""
        names = fb.lora_names
        if not names or all(n is None for n in names):
            return None
        if len(names) != fb.batch_size:
            raise ValueError(f"ForwardBatch.lora_names has {len(names)} entries for {fb.batch_size} requests")
        adapters = [None if n is None else self.adapter(n) for n in names]
        return LoRABatch.build(adapters, fb.extend_seq_lens_cpu, self.device, torch_lora_apply)
