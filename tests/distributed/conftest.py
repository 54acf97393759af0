"""Helpers shared by the multi-process tests: tiny random models, process trees, waits."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest
import torch


def make_tiny_model(folder, heads: int, kv_heads: int, layers: int = 2, tied: bool = False) -> str:
    """A random Llama in HF format with SmolLM2's vocabulary (so the default model's tokenizer fits)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=256, tie_word_embeddings=tied)
    path = folder / f"tiny-{heads}-{kv_heads}-{layers}{'-tied' if tied else ''}"
    if not path.exists():
        transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Callable[..., str]:
    folder = tmp_path_factory.mktemp("tiny-models")
    return lambda heads, kv_heads, layers=2, tied=False: make_tiny_model(folder, heads, kv_heads, layers, tied)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """No process left behind: every one exited (a zombie still counts as gone: its parent reaps it)."""
    deadline = time.monotonic() + timeout
    alive: list[psutil.Process] = procs
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes left behind: {[(p.pid, p.cmdline()[-2:]) for p in alive]}")


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until cond() was true; AssertionError naming `what` after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")
