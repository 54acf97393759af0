"""The real Gemma 3 270M file (Google's base model, llama.cpp's Q4_K_M preset: Q4_K, Q6_K, Q5_0 and Q8_0
tensors, five sliding-window layers to one global, a 262,144-token vocabulary) against transformers loaded
from the same GGUF in float32."""

from __future__ import annotations

import os

import pytest
import torch

from tests.model_executor.hand_batch import HandBatch

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n",
    "The largest planet in the solar system is", "In 1969, the first person to walk on the Moon",
    "A recipe for pancakes: first,", "The quick brown fox",
]
NEW_TOKENS = 48
NEAR_TIE = 1e-3  # a top-two margin under this ends a comparison: float rounding may pick either


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    from radixserve.model_loader.default_model import gemma3_270m_path

    return gemma3_270m_path()


@pytest.fixture(scope="module")
def oracle(gemma3_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gemma3_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runners(gemma3_path):
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    common = dict(model_path=gemma3_path, max_total_tokens=8192, max_running_requests=len(PROMPTS))
    exact = ModelRunner(ServerArgs(**common, dtype="float32", quantization="none"))
    fast = ModelRunner(ServerArgs(**common))
    return exact, fast


@pytest.fixture(scope="module")
def prompt_ids(gemma3_path):
    from radixserve.model_loader import get_tokenizer

    tok = get_tokenizer(gemma3_path)
    return [tok(p).input_ids for p in PROMPTS]


def _greedy(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per prompt, all prompts batched (one PREFILL, then DECODE steps)."""
    hb = HandBatch(runner)
    rows = [hb.new_req() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    steps = [list(p) for p in prompts]
    for _ in range(n):
        res = hb.run(list(zip(rows, steps)), full=False)
        ids = res.sample_output.next_token_ids.tolist()
        for i, t in enumerate(ids):
            out[i].append(t)
        steps = [[t] for t in ids]
    hb.release_all()
    return out


def test_config_is_what_the_file_says(runners):
    cfg = runners[0].model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.vocab_size == 262144 and cfg.head_dim == 256
    assert cfg.sliding_window == 512 and cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert cfg.num_key_value_heads == 1 and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_tanh"


@pytest.fixture(scope="module")
def exact_greedy(runners, prompt_ids) -> list[list[int]]:
    """The exact mode's NEW_TOKENS greedy tokens per prompt (both tests below read them: a shorter greedy run
    is a prefix of a longer one)."""
    return _greedy(runners[0], prompt_ids, NEW_TOKENS)


def test_exact_mode_greedy_equals_transformers(oracle, prompt_ids, exact_greedy):
    ours = exact_greedy
    compared = 0
    for prompt, tokens in zip(prompt_ids, ours):
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        top2 = logits.topk(2, dim=-1)
        for j, t in enumerate(tokens):
            if (top2.values[j, 0] - top2.values[j, 1]).item() < NEAR_TIE:
                break
            assert t == int(top2.indices[j, 0]), f"prompt {prompt[:4]}..: token {j} differs"
            compared += 1
    assert compared >= 0.8 * len(PROMPTS) * NEW_TOKENS


def test_fast_default_agrees_with_exact(runners, prompt_ids, exact_greedy):
    """Teacher-forced on the exact mode's greedy output: the default mode (the file's own low-bit blocks)
    picks the same top-1 at >= 90% of positions."""
    exact, fast = runners
    seqs = [p + t[:24] for p, t in zip(prompt_ids, exact_greedy)]
    tops = []
    for runner in (exact, fast):
        hb = HandBatch(runner)
        rows = [hb.new_req() for _ in seqs]
        lp = hb.all_logprobs(hb.run(list(zip(rows, seqs))))
        hb.release_all()
        tops.append(lp.argmax(-1))
    agree = (tops[0] == tops[1]).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.3f}"


def test_sliding_window_pool_gives_the_full_pools_logprobs_bit_for_bit(gemma3_path):
    """The hybrid pool (mem_cache/swa_memory_pool.py) squeezed to its floor (two 512-token windows + 64) against
    one pool for every layer, deterministic kernels: prompts of several windows, chunked, one of them hit in
    the radix tree after its local KV was given up in part: the same tokens and logprobs, bit for bit."""
    import radixserve

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1000, 200000, (1400,), generator=g).tolist()
    prompts = [shared + torch.randint(1000, 200000, (n,), generator=g).tolist() for n in (60, 700)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    runs = []
    for hybrid in (True, False):
        with radixserve.Engine(model_path=gemma3_path, enable_deterministic_inference=True, chunked_prefill_size=512,
                               max_total_tokens=8192, swa_full_tokens_ratio=0.01, disable_hybrid_swa_memory=not hybrid,
                               check_invariants=True, show_progress=False) as eng:
            outs = [eng.generate(input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
            outs.append(eng.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True))
            runs.append((outs, eng.get_server_info()))
    (hyb, info), (full, _) = runs
    assert info["swa"]["swa_tokens"] == 1088 and info["swa"]["swa_tombstoned_tokens"] > 0
    assert hyb[1]["meta_info"]["cached_tokens"] >= 1024  # the shared prefix, past its tombstoned windows
    for h, f in zip(hyb, full):
        assert h["output_ids"] == f["output_ids"]
        assert h["meta_info"]["output_token_logprobs"] == f["meta_info"]["output_token_logprobs"]
