"""The disk tier with LoRA adapters: a prefix computed under an adapter is stored under that adapter's identity
(its files), so after a restart only the same adapter hits it; the base model and another adapter never do."""

from __future__ import annotations

from tests.lora.lora_driver import run

PROMPT = list(range(1000, 1300))  # 300 tokens: 4 whole blocks of 64 in what a match can take


def test_a_restart_hits_only_the_adapter_that_computed_it(make_lora_scheduler, tmp_path) -> None:
    storage = str(tmp_path / "hc")
    first = make_lora_scheduler(enable_hierarchical_cache=True, hicache_storage_dir=storage)
    ref = run(first, {"a": (PROMPT, "a")})
    first.tree_cache.close()
    assert first.get_server_info()["hicache"]["storage_written_blocks"] == 4

    again = make_lora_scheduler(enable_hierarchical_cache=True, hicache_storage_dir=storage)
    others = run(again, {"base": (PROMPT, None), "b": (PROMPT, "b")})
    assert others["base"].meta["cached_tokens"] == 0 and others["b"].meta["cached_tokens"] == 0
    got = run(again, {"a": (PROMPT, "a")})
    assert got["a"].meta["cached_tokens"] == 256
    assert got["a"].ids == ref["a"].ids
    assert again.get_server_info()["hicache"]["storage_hit_tokens"] == 256
    again.tree_cache.storage.close()
