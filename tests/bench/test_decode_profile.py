"""The batch-1 step split of `bench one-batch --profile` (bench/decode_profile.py) on the default model's
native decode stack: the parts add up to the step, each kernel family is counted as often as the model runs
it, each GEMV's bytes are its blocks' bytes, and the pools are left as found."""

from __future__ import annotations

import pytest
import torch

from radixserve.bench import decode_profile
from radixserve.model_executor.cpu_graph_runner import _projections

STEPS = 6


@pytest.fixture(scope="module")
def prof(fast_runner):
    if fast_runner.cpu_graph_runner is None:
        pytest.skip("no native decode stack on this machine")
    alloc, rows = fast_runner.token_to_kv_pool_allocator, fast_runner.req_to_token_pool
    before = (alloc.available_size(), rows.available_size())
    out = decode_profile.profile_batch1(fast_runner, context_len=40, steps=STEPS, warmup=2)
    assert (alloc.available_size(), rows.available_size()) == before, "the profile leaked KV slots or rows"
    return out


def test_parts_add_up_to_the_step(prof):
    parts = {p["part"]: p for p in prof["parts"]}
    assert prof["steps"] == STEPS and prof["step_ms"] > 0
    assert prof["kernel_ms"] + prof["outside_ms"] == pytest.approx(prof["step_ms"])
    assert sum(p["ms"] for p in prof["parts"]) == pytest.approx(prof["step_ms"], rel=1e-9)
    assert sum(p["pct_of_step"] for p in prof["parts"]) == pytest.approx(100.0)
    for name in ("embed", "attention", "lm head + logits", "sample", "qkv_proj", "down_proj"):
        assert parts[name]["kind"] == "kernel" and parts[name]["ms"] > 0
    assert prof["outside_pct"] == pytest.approx(100.0 * prof["outside_ms"] / prof["step_ms"])
    assert prof["parallel_region_us"] > 0
    assert prof["stream_gb_per_s"] > 0 and prof["weight_bytes"] > 0


def test_each_kernel_family_counted_once_per_layer(prof, fast_runner):
    layers = len(fast_runner.model.model.layers)
    calls = {p["part"]: p.get("calls_per_step") for p in prof["parts"]}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention", "rope_kv_write", "act_fn"):
        assert calls[name] == layers, name
    assert calls["act_quant"] == 4 * layers  # before each of the four projections
    assert calls["rms_norm"] == 2 * layers + 1  # two a layer (pre-norm Llama) and the final norm


def test_parallel_regions_are_those_opened(prof, fast_runner):
    """At one row the row-parallel kernels run inline: a step opens a region for each layer's four GEMVs and its
    attention (several kv heads), one for the LM head, and none at all on one thread."""
    layers = len(fast_runner.model.model.layers)
    if torch.get_num_threads() == 1:
        assert prof["parallel_regions_per_step"] == 0
    else:
        assert prof["parallel_regions_per_step"] == 5 * layers + 1
    assert prof["handoff_ms_estimate"] == pytest.approx(
        prof["parallel_regions_per_step"] * prof["parallel_region_us"] / 1e3)


def test_gemv_bytes_are_the_blocks_bytes(prof, fast_runner):
    """gb_per_s x ms recovers each projection family's bytes a step: its low-bit blocks, scales and mins."""
    per_family = [0, 0, 0, 0]
    for layer in fast_runner.model.model.layers:
        for i, proj in enumerate(_projections(layer)):
            qw = proj.qweight
            per_family[i] += qw.data.nbytes + qw.d.nbytes + (qw.m.nbytes if qw.m is not None else 0)
    parts = {p["part"]: p for p in prof["parts"]}
    for name, expected in zip(decode_profile.GEMV_PHASES, per_family, strict=True):
        got = parts[name]["gb_per_s"] * 1e9 * parts[name]["ms"] * 1e-3
        assert got == pytest.approx(expected, rel=1e-6), name


def test_bad_arguments_are_refused(fast_runner):
    with pytest.raises(ValueError, match="context_len and steps"):
        decode_profile.profile_batch1(fast_runner, context_len=0)


@pytest.mark.parametrize("steps", ["0", "-5", "100000000"])
def test_absurd_profile_steps_are_refused_before_loading(steps):
    from radixserve.bench import one_batch

    with pytest.raises(SystemExit, match="--profile-steps"):
        one_batch.main(["--profile", "--profile-steps", steps])
