"""Precision knobs: --dtype auto (chosen at run time from what this CPU reports), CPU bf16 GEMMs with
float32 everywhere else, and --kv-cache-dtype bfloat16 (the paged kernels and the native decode stack
widen it on load; the pool holds the rounded values)."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops, native_bf16_matmul
from radixserve.layers.linear import onednn_linear_available, resolve_low_bit_max_rows
from radixserve.model_executor.model_runner import ModelRunner, resolve_dtype
from radixserve.server_args import ServerArgs
from tests.model_executor.hand_batch import HandBatch

ops, why = load_cpu_ops()
CPU = torch.device("cpu")


def test_dtype_auto_reads_the_cpu() -> None:
    assert native_bf16_matmul(frozenset({"avx2", "amx_bf16", "amx_tile"}))
    assert native_bf16_matmul(frozenset({"avx512f", "avx512_bf16"}))
    assert not native_bf16_matmul(frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}))
    here = native_bf16_matmul() and onednn_linear_available(torch.bfloat16)
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if here else torch.float32)
    assert resolve_dtype("auto", CPU, deterministic=True) == torch.float32
    assert resolve_dtype("float32", CPU) == torch.float32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="ServerArgs.dtype"):
        ServerArgs(dtype="int3")
    with pytest.raises(ValueError, match="ServerArgs.kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="ServerArgs.kv_cache_dtype: fp8_e5m2 is not implemented.*fp8_e4m3"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="ServerArgs.enable_deterministic_inference"):
        ServerArgs(dtype="bfloat16", enable_deterministic_inference=True)
    # which steps run low-bit: every one on every CPU kind (AMX's long steps on AMX-INT8 tiles), unless capped
    assert resolve_low_bit_max_rows(None) is None and resolve_low_bit_max_rows(0) is None
    assert resolve_low_bit_max_rows(7) == 7
    for absurd in (0, -5, 1 << 40):
        if absurd == 0:
            continue  # 0 is "auto" like None
        with pytest.raises(ValueError, match="ServerArgs.quant_max_rows"):
            ServerArgs(quant_max_rows=absurd)


def _tiny(tmp_path) -> str:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    hb = HandBatch(runner)
    row = hb.new_req()
    out = [hb.run([(row, [5, 17, 99, 3, 42, 7])], full=False).logits_output.next_token_logits.clone()]
    for t in (11, 12, 13):
        out.append(hb.run([(row, [t])], full=False).logits_output.next_token_logits.clone())
    hb.release_all()
    return out


@pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")
def test_cpu_bf16_gemms_keep_float32_activations(tmp_path) -> None:
    """--dtype bfloat16 on a CPU: weights and GEMMs in bf16 (oneDNN where the CPU runs bf16 natively,
    plain torch elsewhere), activations / norms / attention / sampling in float32, KV cache bf16 (auto)."""
    path = _tiny(tmp_path)
    base = dict(model_path=path, max_total_tokens=256, max_running_requests=4)
    f32 = ModelRunner(ServerArgs(dtype="float32", **base))
    bf = ModelRunner(ServerArgs(dtype="bfloat16", **base))
    assert bf.dtype == torch.bfloat16 and bf.act_dtype == torch.float32
    assert bf.kv_cache_dtype == torch.bfloat16 and bf.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
    assert bf.model.model.layers[0].mlp.gate_up_proj.gemm_dtype == torch.bfloat16
    assert bf.model.model.embed_tokens.weight.dtype == torch.float32  # the residual stream stays float32
    for a, b in zip(_logits(f32), _logits(bf)):
        assert b.dtype == torch.float32
        assert not torch.equal(a, b)  # the bf16 GEMMs ran
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)


# (KV dtype, its storage dtype, greedy tokens that must match the float32 cache's, share of all 16 that must):
# e4m3 keeps 3 mantissa bits, so a 135M model's greedy text drifts sooner
KV_CASES = [("bfloat16", torch.bfloat16, 8, 0.9), ("int8", torch.int8, 8, 0.9),
            ("fp8_e4m3", torch.float8_e4m3fn, 2, 0.5)]


@pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")
@pytest.mark.parametrize("kv,storage,prefix,share", KV_CASES, ids=[c[0] for c in KV_CASES])
def test_low_precision_kv_cache_on_the_default_model(model_runner, make_scheduler, tokenizer, kv, storage, prefix,
                                                     share) -> None:
    """Exact-mode weights with a bf16, q8_0 (int8) or fp8 KV cache: the pool holds it, the greedy output stays the
    float32 cache's on these prompts (the first `prefix` tokens; `share` of them all)."""
    from tests.managers.driver import greedy, run

    prompts = {f"p{i}": tokenizer.encode(p, add_special_tokens=False) for i, p in enumerate(
        ["The capital of France is", "A radix tree is a data structure that", "List five fruits:"])}
    want = run(make_scheduler(), prompts, greedy(16), logprobs=False)
    sched = make_scheduler(kv_cache_dtype=kv)
    assert sched.model_runner.token_to_kv_pool.k_buffer[0].dtype == storage
    got = run(sched, prompts, greedy(16), logprobs=False)
    agree = sum(a == b for r in prompts for a, b in zip(want[r].output_ids, got[r].output_ids)) / (16 * len(prompts))
    print(f"{kv} KV vs float32 KV: {agree:.0%} of greedy tokens agree")
    assert all(want[r].output_ids[:prefix] == got[r].output_ids[:prefix] for r in prompts)
    assert agree >= share
