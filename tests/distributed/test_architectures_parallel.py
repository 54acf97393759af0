"""The new architectures split over real ranks (gloo): Gemma 3 (sliding-window layers, QK-norm, one KV head
that tp 2 replicates; on the hybrid sliding-window pool squeezed to its floor, with an int8 KV cache) and Qwen3 at
tp 2 and pp 2 give the one-process greedy tokens and logprobs."""

from __future__ import annotations

import pytest

import radixserve
from tests.models.test_architectures import LONG, make_hf_model


@pytest.mark.parametrize("arch,extra,serve", [
    ("gemma3", {"num_key_value_heads": 1}, {"kv_cache_dtype": "int8", "swa_full_tokens_ratio": 0.01}),
    ("qwen3", {}, {}),
])
def test_tp2_and_pp2_match_one_process(tmp_path, default_model_path, arch, extra, serve) -> None:
    path = tmp_path / arch
    make_hf_model(arch, path, **extra)
    ids = [[(7 * i + 3) % 300 for i in range(LONG)], [5, 17, 99, 3, 42]]  # the first reaches past the window
    outs = {}
    for layout in ({}, {"tp_size": 2}, {"pp_size": 2}):
        with radixserve.Engine(model_path=str(path), tokenizer_path=default_model_path, max_total_tokens=1024,
                               num_threads=1, quantization="none", dtype="float32", check_invariants=True,
                               show_progress=False, **layout, **serve) as eng:
            outs[str(layout)] = eng.generate(input_ids=ids, sampling_params={
                "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, return_logprob=True)
    base = outs["{}"]
    for key, got in outs.items():
        for a, b in zip(base, got):
            assert a["output_ids"] == b["output_ids"], key
            lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
            lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
            assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4, key
