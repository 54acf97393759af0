"""The weight cache on real server processes (model_loader/weight_cache.py): a first start packs the default model
and writes its layers beside the config; a restart maps them (`/get_server_info` says how many bytes) and answers
as the first did; a restart over a damaged cache file is a miss that still answers the same, and writes it again."""

from __future__ import annotations

import glob
import os
import time

import httpx

from tests.server_process import ServerProcess


def _chat(base_url: str) -> str:
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _mapped(base_url: str) -> int:
    return httpx.get(base_url + "/get_server_info", timeout=30).json()["memory_budget"]["weights_mapped_bytes"]


def _wait_for_index(cache: str, server: ServerProcess) -> list[str]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        index = glob.glob(os.path.join(cache, "gguf", "*", "weights-*.json"))
        if index:
            return glob.glob(os.path.join(cache, "gguf", "*", "weights-*.bin"))
        time.sleep(0.1)
    raise AssertionError(f"no weight cache index after 120 s:\n{server.log()}")


def test_a_restart_maps_what_the_first_start_packed(tmp_path) -> None:
    cache = str(tmp_path / "cache")
    env = {"RADIXSERVE_CACHE_DIR": cache, "RADIXSERVE_NO_GGUF_CACHE": ""}
    first = ServerProcess(["--max-total-tokens", "2048"], env=env)
    for s in first.running():
        assert _mapped(s.base_url) == 0
        want = _chat(s.base_url)
        (bin_path,) = _wait_for_index(cache, s)
    second = ServerProcess(["--max-total-tokens", "2048"], env=env)
    for s in second.running():
        assert _mapped(s.base_url) > 50 * 2**20  # most of the default model's ~100 MB of packed layers
        assert _chat(s.base_url) == want
    with open(bin_path, "r+b") as fh:  # a byte flipped in the middle: a miss, never a misread
        fh.seek(os.path.getsize(bin_path) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 1]))
    third = ServerProcess(["--max-total-tokens", "2048", "--log-level", "info"], env=env)
    for s in third.running():
        assert _mapped(s.base_url) == 0
        assert _chat(s.base_url) == want
        _wait_for_index(cache, s)
    with open(third.log_path, errors="replace") as fh:
        assert "checksum mismatch" in fh.read()
