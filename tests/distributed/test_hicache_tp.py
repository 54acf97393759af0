"""The disk tier at tensor parallel 3 (gloo, real rank processes): every rank saves its own shard of the KV under
an identity naming its rank, and after a restart the ranks agree on what to restore. With one block file gone from
one rank only, all three restore the shorter prefix (an all-reduce of the minimum): --check-invariants compares
every step's digest across the ranks, so a rank that restored more would fail the step."""

from __future__ import annotations

import glob
import json
import os

import radixserve
from radixserve.mem_cache.hicache_storage import HEADER_BYTES, MAGIC, chain_keys

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _engine(storage: str) -> radixserve.Engine:
    return radixserve.Engine(tp_size=3, quantization="none", dtype="float32", max_total_tokens=4096,
                             context_length=512, check_invariants=True, show_progress=False,
                             enable_hierarchical_cache=True, hicache_storage_dir=storage)


def test_tp3_ranks_restore_the_same_prefix(tmp_path) -> None:
    storage = str(tmp_path / "hc")
    prompt = list(range(1000, 1300))  # 300 tokens: blocks 0..3 of the prompt
    with _engine(storage) as eng:
        first = eng.generate(input_ids=prompt, sampling_params=PARAMS)
    assert first["meta_info"]["cached_tokens"] == 0
    folders = sorted(glob.glob(os.path.join(storage, "*")))
    assert len(folders) == 3  # one identity per rank
    assert all(len(glob.glob(os.path.join(f, "*", "*.kv"))) == 4 for f in folders)
    # take block 2 from one rank only
    any_file = glob.glob(os.path.join(folders[1], "*", "*.kv"))[0]
    with open(any_file, "rb") as f:
        identity = json.loads(f.read(len(MAGIC) + HEADER_BYTES)[len(MAGIC):].rstrip(b" \0"))["identity"]
    key = chain_keys(identity, "", prompt, 64, 3)[2]
    os.unlink(os.path.join(folders[1], key[:2], key + ".kv"))

    with _engine(storage) as eng:
        again = eng.generate(input_ids=prompt, sampling_params=PARAMS)
        tiers = eng.get_server_info()["hicache"]
    assert again["meta_info"]["cached_tokens"] == 128  # blocks 0 and 1: what every rank holds
    assert again["output_ids"] == first["output_ids"]
    assert tiers["storage_hit_tokens"] == 128  # rank 0 reports the replica (its ranks restored alike)
