"""The hybrid sliding-window pool (mem_cache/swa_memory_pool.py, swa_radix_cache.py) through the real scheduler:
the same requests on the same tiny window models (Gemma 3, Gemma 2, Mistral) with the local pool squeezed to
its minimum (every window tombstoned, chunks cut by the local budget, requests retracted) and with one pool for
every layer (--disable-hybrid-swa-memory) give the same greedy tokens; in the deterministic mode (batch-invariant
kernels: the schedules differ, the arithmetic may not) the same logprobs, bit for bit. Every step's KV
accounting of both pools is checked (check_invariants)."""

from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.test_architectures import W, make_hf_model

NEW = 12


@pytest.fixture(scope="module", params=["gemma3", "gemma2", "mistral_window"])
def window_model(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = tmp_path_factory.mktemp(request.param) / "hf"
    make_hf_model(request.param, path)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 300, (8 * W,), generator=g).tolist()  # a prefix of eight windows
    prompts = [shared + torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 3, W, 2 * W + 1, 7 * W)]
    prompts += [torch.randint(0, 300, (n,), generator=g).tolist() for n in (2, 6 * W, 13 * W)]
    prompts.append(shared[: 3 * W] * 3)  # repeats: the n-gram drafter proposes from them
    return str(path), prompts


def _run(path: str, tokenizer: str, prompts: list[list[int]], **kw) -> tuple[list[dict], dict]:
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    with radixserve.Engine(model_path=path, tokenizer_path=tokenizer, quantization="none", dtype="float32",
                           check_invariants=True, show_progress=False, **kw) as eng:
        first = eng.generate(input_ids=prompts[:2], sampling_params=params, return_logprob=True)  # warm the tree
        rest = eng.generate(input_ids=prompts[2:], sampling_params=params, return_logprob=True)
        again = eng.generate(input_ids=prompts[:3], sampling_params=params, return_logprob=True)  # radix hits
        info = eng.get_server_info()
    return [*first, *rest, *again], info


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]


# the local pool at its floor (2 windows + 64 slots) beside a full pool that holds every request: each chunk is
# cut by the local budget and old windows are tombstoned while requests run
SQUEEZE = {"max_total_tokens": 640, "swa_full_tokens_ratio": 0.01, "max_running_requests": 6}


@pytest.mark.parametrize("args", [
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3},
    {"page_size": 4, "attention_backend": "torch_native"},
    {"max_total_tokens": 160, "swa_full_tokens_ratio": 0.5},  # a full pool too small for the batch: retractions
], ids=["chunked-mixed", "ngram", "page4-torch-native", "retract"])
def test_squeezed_local_pool_gives_the_full_pools_tokens(window_model, default_model_path, args) -> None:
    path, prompts = window_model
    hybrid, info = _run(path, default_model_path, prompts, **{**SQUEEZE, **args})
    full, full_info = _run(path, default_model_path, prompts, disable_hybrid_swa_memory=True, **{**SQUEEZE, **args})
    assert [o["output_ids"] for o in hybrid] == [o["output_ids"] for o in full]
    for h, f in zip(hybrid, full):
        assert _logprobs(h) == pytest.approx(_logprobs(f), abs=2e-4)
    swa = info["swa"]
    retract = args.get("max_total_tokens") == 160
    assert swa["swa_tokens"] == (80 if retract else 2 * W + 64) and swa["full_tokens"] > swa["swa_tokens"]
    assert swa["swa_tombstoned_tokens"] > 0 or retract  # windows were given up
    assert "swa" not in full_info
    # prefixes longer than eight windows still hit: their last window survived in the local pool
    assert max(o["meta_info"]["cached_tokens"] for o in hybrid) >= 8 * W
    if retract:
        assert info["num_retractions"] > 0


def test_deterministic_logprobs_are_bitwise_equal(window_model, default_model_path) -> None:
    path, prompts = window_model
    args = {**SQUEEZE, "enable_deterministic_inference": True, "chunked_prefill_size": 24}
    hybrid, info = _run(path, default_model_path, prompts, **args)
    full, _ = _run(path, default_model_path, prompts, disable_hybrid_swa_memory=True, **args)
    assert [o["output_ids"] for o in hybrid] == [o["output_ids"] for o in full]
    assert [_logprobs(o) for o in hybrid] == [_logprobs(o) for o in full]  # bit for bit
    assert info["swa"]["swa_tombstoned_tokens"] > 0
