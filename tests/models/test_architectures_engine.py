"""The window architectures through the real scheduler (Engine): radix-cache hits longer than the window,
chunked prefill whose chunks straddle the window edge, MIXED steps and n-gram speculative decoding; every
request's greedy tokens equal transformers' generate() on the same prompt."""

from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.test_architectures import LONG, W, make_hf_model

NEW = 10


@pytest.fixture(scope="module", params=["gemma3", "gemma2", "mistral_window"])
def tiny_window_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model = make_hf_model(request.param, path)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 300, (LONG + 2,), generator=g).tolist()  # shared, longer than 3 windows
    prompts = [prefix + torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, W + 1, 2 * W)]
    prompts.append(prefix[:7] + prefix[:7] + prefix[:7])  # repeats: the n-gram drafter has something to propose
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return str(path), prompts, refs


@pytest.mark.parametrize("args", [
    {"chunked_prefill_size": 7, "enable_mixed_chunk": True},
    {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3},
], ids=["chunked-mixed", "ngram"])
def test_engine_greedy_equals_transformers(tiny_window_model, default_model_path, args) -> None:
    path, prompts, refs = tiny_window_model
    with radixserve.Engine(model_path=path, tokenizer_path=default_model_path, max_total_tokens=2048,
                           quantization="none", dtype="float32", check_invariants=True, show_progress=False,
                           **args) as eng:
        params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        first = eng.generate(input_ids=prompts[0], sampling_params=params)  # fills the radix cache
        rest = eng.generate(input_ids=prompts[1:], sampling_params=params)
    outs = [first, *rest]
    for out, ref in zip(outs, refs):
        assert out["output_ids"] == ref
    # the later requests reused the first one's prefix, which is longer than three windows
    assert all(o["meta_info"]["cached_tokens"] >= 3 * W for o in rest[:2])
