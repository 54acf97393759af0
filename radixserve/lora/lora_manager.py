"""LoRAManager: the adapters a runner knows, the ones held in memory (an LRU), and who is using them.

    registration (uid)   name, config; created by --lora-paths or /load_lora_adapter; ended by unload
    refs                 requests accepted with this registration (queued, running): an unloaded
                         adapter's registration lives on, invisible to new requests, until its refs are 0
    pins                 admitted requests: their adapter's weights must stay in memory (never evicted)
    loaded (LRU)         weights in memory, at most --max-loaded-loras; unpinned ones are evicted first

The uid is given at registration and never reused: it is the adapter's namespace in the radix cache (a
prefix computed under one adapter is never served to another, nor to a later adapter of the same name)
and what a step's rows name (so a request admitted before an unload + reload of the name keeps its own
weights).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.lora.lora_adapter import LoRAAdapter, load_adapter, read_lora_config
from radixserve.lora.lora_batch import LoRABatch, install_lora_hooks, torch_lora_apply
from radixserve.lora.lora_config import LoRAConfig, LoRANotFound, check_adapter_name
from radixserve.lora.lora_dense import DenseCache

logger = logging.getLogger(__name__)


@dataclass
class _Registration:
    config: LoRAConfig
    uid: int
    refs: int = 0
    pins: int = 0
    active: bool = True  # False once unloaded: no new request may take it


class LoRAManager:
    def __init__(self, model: nn.Module, paths: dict[str, str], max_rank: int, max_loaded: int,
                 dtype: torch.dtype, device: torch.device, ps: object = None, cpu_ops: Any = None,
                 sgmv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.dtype, self.device = dtype, device
        self.ps = ps  # tensor parallel: this rank's slices of A / B, and the row-parallel all-reduce
        self._uids = itertools.count(1)  # 0 is the base model's namespace
        self.regs: dict[int, _Registration] = {}  # uid -> registration (active, or unloaded with users)
        self.by_name: dict[str, int] = {}  # name -> uid of its active registration
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.apply = torch_lora_apply
        # few-row steps (decode, verify): the adapters side by side, through lora_sgmv where it runs (lora_dense.py)
        self.dense_cache = DenseCache(dtype, cpu_ops if device.type == "cpu" else None, sgmv_dtype or dtype,
                                      limit=max_loaded)
        self.said_layer_by_layer = False  # runner_setup.lora_batch_for logs the fallback once
        install_lora_hooks(model, ps)
        for name, path in paths.items():
            self.register(name, path)  # every adapter is read and checked at start-up

    # ------------------------------------------------------------------ registry
    def names(self) -> list[str]:
        return list(self.by_name)

    def register(self, name: str, path: str) -> int:
        """Read, check and load adapter `name`; its uid. A ValueError naming it on any problem."""
        check_adapter_name(name)
        if name in self.by_name:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        config = read_lora_config(name, path, self.max_rank)
        uid = next(self._uids)
        adapter = load_adapter(config, self.model, uid, self.dtype, self.device, self.ps)
        self.regs[uid] = _Registration(config, uid)
        self.by_name[name] = uid
        self._insert(adapter)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections, %.1f MB)", name, path, config.r,
                    len(adapter.weights), adapter.nbytes() / 2**20)
        return uid

    def unregister(self, name: str) -> int:
        """New requests for `name` are refused from now on; its weights go when its last request is done.
        Returns the uid (users(uid) says how many requests still use it)."""
        uid = self.by_name.pop(name, None)
        if uid is None:
            raise LoRANotFound(name)
        reg = self.regs[uid]
        reg.active = False
        self._maybe_forget(reg)
        logger.info("LoRA adapter %r unloaded (%d requests still use it)", name, reg.refs)
        return uid

    def users(self, uid: int) -> int:
        reg = self.regs.get(uid)
        return 0 if reg is None else reg.refs

    def _maybe_forget(self, reg: _Registration) -> None:
        if not reg.active and reg.refs == 0:
            del self.regs[reg.uid]
            self.loaded.pop(reg.uid, None)
            self.dense_cache.forget(reg.uid)  # its weights go now

    # ------------------------------------------------------------------ requests
    def acquire(self, name: str) -> int:
        """A request arrives naming `name`: its uid (LoRANotFound when not loaded), counted as a user."""
        uid = self.by_name.get(name)
        if uid is None:
            raise LoRANotFound(name)
        self.regs[uid].refs += 1
        return uid

    def release(self, uid: int, pinned: bool) -> None:
        reg = self.regs[uid]
        reg.refs -= 1
        if pinned:
            reg.pins -= 1
        self._maybe_forget(reg)

    def can_pin(self, uid: int) -> bool:
        """Whether `uid` is in memory or can be brought in without evicting a pinned adapter."""
        return uid in self.loaded or len(self.loaded) < self.max_loaded or any(
            not self.regs[u].pins for u in self.loaded)

    def pin(self, uid: int) -> LoRAAdapter:
        """The adapter a request admitted now will use, read again if the LRU dropped it; held until
        release. A ValueError when its files changed and no longer load."""
        reg = self.regs[uid]
        adapter = self.loaded.get(uid)
        if adapter is None:
            adapter = load_adapter(reg.config, self.model, uid, self.dtype, self.device, self.ps)
            self._insert(adapter)
        self.loaded.move_to_end(uid)
        reg.pins += 1
        return adapter

    def unpin(self, uid: int) -> None:
        self.regs[uid].pins -= 1

    def adapter(self, uid: int) -> LoRAAdapter:
        """A pinned adapter's weights (what a step's rows use)."""
        return self.loaded[uid]

    def _insert(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.uid] = adapter
        while len(self.loaded) > self.max_loaded:
            victim = next((u for u in self.loaded if not self.regs[u].pins and u != adapter.uid), None)
            if victim is None:
                break  # every other adapter is pinned: can_pin() kept this from happening at admission
            del self.loaded[victim]
            self.dense_cache.forget(victim)  # its weights go with it

    def info(self) -> dict[str, object]:
        return {"loaded": [self.regs[u].config.name for u in self.loaded if self.regs[u].active],
                "adapters": {n: {"path": self.regs[u].config.path, "rank": self.regs[u].config.r,
                                 "requests": self.regs[u].refs} for n, u in self.by_name.items()},
                "unloading": {r.config.name: r.refs for r in self.regs.values() if not r.active}}

    # ------------------------------------------------------------------ execution
    def batch_for(self, uids: list[int] | None, rows_per_req: list[int]) -> LoRABatch | None:
        """The step's adapter groups (None for a base-only step: the hooks then cost one check each).
        uids: each request's adapter (0 = base; ModelWorkerBatch.lora_uids); rows_per_req: its token rows."""
        if not uids or not any(uids):
            return None
        if len(uids) != len(rows_per_req):
            raise ValueError(f"ForwardBatch.lora_uids has {len(uids)} entries for {len(rows_per_req)} requests")
        adapters = [None if u == 0 else self.adapter(u) for u in uids]
        return LoRABatch.build(adapters, rows_per_req, self.device, self.apply, self.dense_cache)
