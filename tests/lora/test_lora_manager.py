"""LoRAManager's bookkeeping (registrations, users, pins, the LRU) and the LoRA knobs' bounds."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def manager(lora_runner, tiny_adapters):
    from radixserve.lora.lora_manager import LoRAManager

    return LoRAManager(lora_runner.model, {"a": tiny_adapters["a"], "b": tiny_adapters["b"]}, max_rank=16,
                       max_loaded=2, dtype=torch.float32, device=torch.device("cpu"))


def test_unload_waits_for_users_then_forgets(manager, tiny_adapters):
    from radixserve.lora.lora_config import LoRANotFound

    uid = manager.acquire("a")
    manager.pin(uid)
    assert manager.unregister("a") == uid and manager.users(uid) == 1
    with pytest.raises(LoRANotFound, match="'a'"):
        manager.acquire("a")  # new requests: 404
    assert manager.adapter(uid) is not None  # the running request still has its weights
    new_uid = manager.register("a", tiny_adapters["c"])  # the name again: a new registration
    assert new_uid != uid and manager.names() == ["b", "a"]
    manager.release(uid, pinned=True)
    assert manager.users(uid) == 0 and uid not in manager.regs and uid not in manager.loaded


def test_lru_keeps_pinned_adapters_and_reloads_evicted_ones(manager, tiny_adapters):
    manager.register("c", tiny_adapters["c"])  # 3 registered, 2 in memory
    assert len(manager.loaded) == 2
    ua, ub, uc = (manager.acquire(n) for n in ("a", "b", "c"))
    evicted = next(u for u in (ua, ub, uc) if u not in manager.loaded)
    others = [u for u in (ua, ub, uc) if u != evicted]
    for u in others:
        manager.pin(u)
    assert not manager.can_pin(evicted)  # both slots pinned: its request waits
    manager.release(others[0], pinned=True)
    assert manager.can_pin(evicted)
    manager.pin(evicted)  # read again from its folder
    assert evicted in manager.loaded and others[0] not in manager.loaded and len(manager.loaded) == 2


@pytest.mark.parametrize(("kw", "field"), [
    ({"max_lora_rank": 0}, "max_lora_rank"), ({"max_lora_rank": 10**9}, "max_lora_rank"),
    ({"max_loaded_loras": 0}, "max_loaded_loras"), ({"max_loaded_loras": 10**9}, "max_loaded_loras"),
    ({"max_loras_per_batch": 0}, "max_loras_per_batch"), ({"max_loras_per_batch": 9, "max_loaded_loras": 8},
                                                           "max_loras_per_batch"),
    ({"lora_paths": ("a=/x", "a=/y")}, "lora_paths"), ({"lora_paths": ("../up=/x",)}, "lora_paths"),
    ({"lora_paths": ("a=",)}, "lora_paths"), ({"lora_dir": "/no/such/dir"}, "lora_dir"),
    ({"enable_lora": True, "pp_size": 2}, "enable_lora"),
    ({"enable_lora": True, "speculative_algorithm": "draft_model", "speculative_draft_model_path": "/x"},
     "enable_lora"),
])
def test_lora_knobs_have_bounds(kw, field):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=field):
        ServerArgs(**kw)


def test_cli_takes_several_lora_paths():
    import argparse

    from radixserve.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(["--lora-paths", "a=/x", "b=/y", "--max-lora-rank", "8"]))
    assert args.lora_paths == ("a=/x", "b=/y") and args.enable_lora and args.max_lora_rank == 8
