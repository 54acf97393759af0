"""LoRAScheduling: the scheduler's side of adapters (who may run with which adapter this step).

- at arrival: the adapter a request names must be registered (else a 404 naming it); the request takes
  the adapter's uid, its radix cache namespace (mem_cache/cache_namespace.py);
- at admission: the distinct adapters of the running requests plus those admitted this step stay within
  --max-loras-per-batch, and the adapter must fit the in-memory LRU beside the pinned ones; a request
  that does not fit waits (the queue behind it still runs: requests are deferred, never serialised);
- an admitted request pins its adapter until it finishes or is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.lora.lora_manager import LoRAManager, LoRANotFound

if TYPE_CHECKING:
    from radixserve.managers.req import Req


class LoRAScheduling:
    def __init__(self, manager: LoRAManager | None, max_per_batch: int) -> None:
        self.manager = manager
        self.max_per_batch = max_per_batch

    def resolve(self, lora_path: str | None) -> tuple[str | None, int]:
        """(adapter name, radix namespace) for a request; LoRANotFound / ValueError when it cannot run."""
        if lora_path is None:
            return None, 0
        if self.manager is None:
            raise LoRANotFound(lora_path)
        return lora_path, self.manager.uid(lora_path)

    def allows(self, req: Req, running: list[Req], admitted: list[Req]) -> bool:
        name = req.lora_name
        if name is None or self.manager is None:
            return True
        active = {r.lora_name for r in running if r.lora_name is not None}
        active |= {r.lora_name for r in admitted if r.lora_name is not None}
        if name in active:
            return True
        return len(active) < self.max_per_batch and self.manager.can_pin(name)

    def pin(self, req: Req) -> None:
        if req.lora_name is not None and not req.lora_pinned and self.manager is not None:
            self.manager.pin(req.lora_name)
            req.lora_pinned = True

    def release(self, req: Req) -> None:
        if req.lora_pinned and self.manager is not None:
            self.manager.unpin(req.lora_name)
            req.lora_pinned = False
