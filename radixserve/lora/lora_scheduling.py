"""LoRAScheduling: the scheduler's side of adapters (who may run with which adapter this step).

- at arrival: the adapter a request names must be loaded (else a 404 naming it); the request takes the
  registration's uid, its radix cache namespace (mem_cache/cache_namespace.py), and counts as one of its
  users until it finishes (an unload waits for those);
- at admission: the distinct adapters of the running requests plus those admitted this step stay within
  --max-loras-per-batch, and the adapter must fit the in-memory LRU beside the pinned ones; a request
  that does not fit waits (the queue behind it still runs: requests are deferred, never serialised);
- an admitted request pins its adapter's weights until it finishes or is dropped.

It also answers the control calls (/load_lora_adapter, /unload_lora_adapter: LoRAControlReq).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.lora.lora_config import LoRANotFound
from radixserve.lora.lora_manager import LoRAManager
from radixserve.managers.io_struct import LoRAControlReq, RpcOutput

if TYPE_CHECKING:
    from radixserve.managers.req import Req


class LoRAScheduling:
    def __init__(self, manager: LoRAManager | None, max_per_batch: int) -> None:
        self.manager = manager
        self.max_per_batch = max_per_batch
        self.failed: list[Req] = []  # requests whose adapter could not be read again at admission

    def resolve(self, lora_path: str | None) -> tuple[str | None, int]:
        """(adapter name, uid) for an arriving request, counted as a user; LoRANotFound when not loaded."""
        if lora_path is None:
            return None, 0
        if self.manager is None:
            raise LoRANotFound(lora_path)
        return lora_path, self.manager.acquire(lora_path)

    def allows(self, req: Req, running: list[Req], admitted: list[Req]) -> bool:
        """Whether `req` may join this step; a request whose adapter no longer loads goes to `failed`."""
        uid = req.lora_uid
        if uid == 0 or self.manager is None:
            return True
        active = {r.lora_uid for r in running if r.lora_uid} | {r.lora_uid for r in admitted if r.lora_uid}
        if uid not in active and len(active) >= self.max_per_batch:
            return False
        if req.lora_pinned:
            return True
        if not self.manager.can_pin(uid):
            return False
        try:
            self.manager.pin(uid)  # reads the adapter again if the LRU dropped it
        except ValueError as e:
            req.error = (500, f"LoRA adapter {req.lora_name!r} could not be read again: {e}")
            self.failed.append(req)
            return False
        req.lora_pinned = True
        return True

    def take_failed(self) -> list[Req]:
        out, self.failed = self.failed, []
        return out

    def release_finished(self, reqs: list[Req]) -> None:
        """Requests that are done (finished, aborted, failed, refused) stop using their adapter; called on
        the outputs of every step, which every way a request ends goes through. Idempotent."""
        if self.manager is None:
            return
        for req in reqs:
            if req.lora_uid and req.finished_reason is not None and not req.lora_released:
                req.lora_released = True
                self.manager.release(req.lora_uid, req.lora_pinned)
                req.lora_pinned = False

    def unpin_waiting(self, waiting: list[Req], admitted: list[Req]) -> None:
        """Pins are held by admitted requests only: a waiting one (not admitted this step, or retracted)
        gives its pin back, so the LRU may drop its adapter while it waits."""
        keep = {id(r) for r in admitted}
        for req in waiting:
            if req.lora_pinned and self.manager is not None and id(req) not in keep:
                self.manager.unpin(req.lora_uid)
                req.lora_pinned = False

    # ------------------------------------------------------------------ control calls
    def control(self, op: str, name: str, path: str | None, uid: int) -> dict[str, Any]:
        """load / unload / users / list; raises LoRANotFound (404) or ValueError (400)."""
        m = self.manager
        if m is None:
            raise ValueError("LoRA is not enabled on this server: start it with --enable-lora or --lora-paths")
        if op == "load":
            if path is None:
                raise ValueError("lora_path: the adapter's folder or .gguf file is required")
            return {"uid": m.register(name, path)}
        if op == "unload":
            uid = m.unregister(name)
            return {"uid": uid, "users": m.users(uid)}
        if op == "users":
            return {"uid": uid, "users": m.users(uid)}
        if op == "list":
            return m.info()
        raise ValueError(f"unknown LoRA control op {op!r}")


def answer_lora_control(lora: LoRAScheduling, msg: LoRAControlReq, dp_rank: int) -> RpcOutput:
    """The scheduler's answer: data holds the result, or error + status (404 unknown, 400 bad adapter)."""
    try:
        data = lora.control(msg.op, msg.name, msg.path, msg.uid)
        return RpcOutput("lora", ok=True, data=data, rpc_id=msg.rpc_id, dp_rank=dp_rank)
    except LoRANotFound as e:
        return RpcOutput("lora", ok=False, data={"error": str(e), "status": 404}, rpc_id=msg.rpc_id, dp_rank=dp_rank)
    except ValueError as e:
        return RpcOutput("lora", ok=False, data={"error": str(e), "status": 400}, rpc_id=msg.rpc_id, dp_rank=dp_rank)
