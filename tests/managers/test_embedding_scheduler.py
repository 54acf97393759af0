"""--is-embedding through the real Scheduler (in-process): the pooled, normalised final hidden state
equals transformers' (output_hidden_states[-1], after the final norm) within 1e-5 in the exact mode,
alone, in a batch of 64, with chunked prefill and with radix-cache hits, for both poolings."""

from __future__ import annotations

import pytest
import torch

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams

TOL = 1e-5


def hf_embedding(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].double()  # after the final norm
    vec = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


def embed_all(sched, prompts: dict[str, list[int]], max_steps: int = 10_000) -> dict[str, list[float]]:
    for rid, ids in prompts.items():
        err = sched.add_request(TokenizedGenerateReqInput(rid, ids, SamplingParams(max_new_tokens=0)))
        assert err is None, err.error
    got: dict[str, list[float]] = {}
    steps = 0
    while sched.has_work() or sched.output_processor.pending:
        for out in sched.step():
            assert out.error is None, out.error
            assert out.new_token_ids == []  # nothing is sampled
            got[out.rid] = out.embedding
        steps += 1
        assert steps < max_steps
    assert set(got) == set(prompts)
    return got


def prompts_of(n: int, seed: int, lo: int = 3, hi: int = 40, shared: list[int] | None = None) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out[f"r{i}"] = (shared or []) + torch.randint(0, 49152, (length,), generator=g).tolist()
    return out


def check(got: dict[str, list[float]], prompts: dict[str, list[int]], model, pooling: str) -> None:
    for rid, ids in prompts.items():
        ref = hf_embedding(model, ids, pooling)
        vec = torch.tensor(got[rid], dtype=torch.float64)
        assert vec.shape == ref.shape
        assert abs(vec.norm().item() - 1.0) < 1e-9
        err = (vec - ref).abs().max().item()
        assert err < TOL, f"{rid} ({len(ids)} tokens, {pooling}): max error {err:.2e}"


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_default_model_alone_batch_chunked_and_cached(make_scheduler, hf_oracle, pooling):
    alone = prompts_of(1, seed=1, lo=30, hi=31)
    check(embed_all(make_scheduler(is_embedding=True, pooling=pooling), alone), alone, hf_oracle, pooling)
    # a batch of 64, each with a shared 40-token prefix: radix hits for last pooling (the first request
    # computes the prefix, the others wait one step for it and reuse it), none for mean
    shared = list(range(100, 140))  # longer than the in-batch window (IN_BATCH_PREFIX_TOKENS)
    batch = prompts_of(64, seed=2, lo=2, hi=24, shared=shared)
    sched = make_scheduler(is_embedding=True, pooling=pooling)
    got = embed_all(sched, batch)
    check(got, batch, hf_oracle, pooling)
    assert sched.forward_ct <= 3  # many inputs per step
    hits = sched.stats["cached_tokens"]
    assert (hits >= 60 * len(shared)) if pooling == "last" else (hits == 0)
    # the same prompts again: the tree now holds them all
    again = embed_all(sched, {f"again-{k}": v for k, v in list(batch.items())[:8]})
    for k, v in again.items():
        assert max(abs(a - b) for a, b in zip(v, got[k[len("again-"):]])) < TOL
    # long prompts through a 16-token chunked prefill: each vector accumulates over its chunks
    long = prompts_of(6, seed=4, lo=40, hi=70)
    chunked = make_scheduler(is_embedding=True, pooling=pooling, chunked_prefill_size=16)
    check(embed_all(chunked, long), long, hf_oracle, pooling)
    assert chunked.forward_ct >= sum(map(len, long.values())) // 16


def test_tiny_model_both_poolings_chunked(tiny_llama, default_model_path):
    from transformers import AutoModelForCausalLM

    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    path = tiny_llama()
    ref_model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = prompts_of(64, seed=3, lo=1, hi=60)
    for pooling in ("last", "mean"):
        args = ServerArgs(model_path=path, tokenizer_path=default_model_path, is_embedding=True, pooling=pooling,
                          dtype="float32", quantization="none", max_total_tokens=8192, max_running_requests=64,
                          chunked_prefill_size=8, check_invariants=True)
        check(embed_all(Scheduler(args), prompts), prompts, ref_model, pooling)


def test_bad_input_then_normal(make_scheduler):
    sched = make_scheduler(is_embedding=True)
    err = sched.add_request(TokenizedGenerateReqInput("bad", [10**9], SamplingParams(max_new_tokens=0)))
    assert err is not None and "input_ids" in err.error
    got = embed_all(sched, {"ok": [1, 2, 3]})
    assert len(got["ok"]) == 576


def test_server_args_refuse_unknown_pooling():
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="pooling"):
        ServerArgs(pooling="cls")
    with pytest.raises(ValueError, match="is_embedding"):
        ServerArgs(is_embedding=True, speculative_algorithm="ngram")
