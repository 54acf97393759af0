"""Tensor parallel over torch.distributed (gloo on this CPU): N real scheduler processes, one per rank,
each holding its shard. The default model (9 query / 3 KV heads) runs at tp 3 and gives the single
process's greedy output; tiny random models cover tp 2 (KV heads split) and tp 4 (KV heads replicated);
sizes that do not divide are refused naming the head counts; --check-invariants compares every step's
digest across ranks (it would raise if the schedulers diverged)."""

from __future__ import annotations

import re

import pytest
import torch

import radixserve

PROMPTS = ["The capital of France is", "A radix tree is", "List three colours:"]


def _engine(**kw):
    kw.setdefault("quantization", "none")
    kw.setdefault("dtype", "float32")  # the exact mode on every CPU (auto is bf16 where bf16 matmul is native)
    return radixserve.Engine(check_invariants=True, show_progress=False, **kw)


def test_default_model_at_tp3_matches_one_process(make_scheduler, tokenizer) -> None:
    """20 prompts x 16 tokens, exact mode: batched at tp 3 (with --check-invariants: every step's digest
    equal on all ranks) they give what each gives alone in one process (near-tie rule); the first
    position's logprobs agree within 1e-4; a second round over the same prefixes hits the radix cache
    on every rank and still gives the same tokens."""
    from tests.managers.driver import compare, greedy, run

    shared = ("You are a helpful assistant. Answer briefly and precisely, in plain English, without "
              "lists or headings. Question: ")
    texts = PROMPTS + ["Why is the sky blue?", "Name a prime number.", "What is a kernel?", "Describe rain.",
                       "Who wrote Hamlet?", "What is 7 times 8?", "Define entropy.", "Say hello in French."]
    texts += [shared + q for q in ("What is a cache?", "What is a tree?", "What is a GPU?", "What is RAM?",
                                   "What is a page?", "What is a token?", "What is a batch?", "What is a step?",
                                   "What is a radix?")]
    prompts = {f"p{i:02d}": tokenizer.encode(t, add_special_tokens=False) for i, t in enumerate(texts)}
    assert len(prompts) == 20
    # one process, all at once (tests/managers/test_batch_invariance.py: the same tokens as each alone)
    alone = run(make_scheduler(disable_radix_cache=True), prompts, greedy(16))
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with _engine(tp_size=3, max_total_tokens=4096, context_length=512) as eng:
        first = eng.generate(input_ids=list(prompts.values()), sampling_params=params, return_logprob=True,
                             top_logprobs_num=2)
        again = eng.generate(input_ids=list(prompts.values())[-9:], sampling_params={**params, "max_new_tokens": 6})
        info = eng.get_server_info()
    assert info["max_total_num_tokens"] >= 4095
    got = {rid: _finished(out) for rid, out in zip(prompts, first)}
    print(f"tp 3, 20 batched: {compare(alone, got)} near-tie divergences excused")
    for rid, out in zip(prompts, first):
        # first position: the gathered logits agree with one process to float32 summation order
        a, b = dict(out["meta_info"]["output_top_logprobs"][0]), dict(alone[rid].top2[0])
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a), rid
    assert all(out["meta_info"]["cached_tokens"] >= 20 for out in again)  # the shared prefix, from the tree
    cut = {rid: _finished({"output_ids": alone[rid].output_ids[:6]}) for rid in list(prompts)[-9:]}
    for rid in cut:
        cut[rid].top2 = alone[rid].top2
    compare(cut, {rid: _finished(o) for rid, o in zip(cut, again)})


def _finished(out: dict):
    from tests.managers.driver import Finished

    return Finished(output_ids=out["output_ids"])


@pytest.mark.parametrize("tp,heads,kv_heads,quant", [(2, 4, 2, "none"), (4, 8, 2, "none"), (2, 4, 2, "int8")])
def test_tiny_models_split_or_replicate_kv_heads(tiny_models, default_model_path, tp, heads, kv_heads, quant) -> None:
    """int8: the low-bit weights (and their kernels) shard like the float ones."""
    path = tiny_models(heads, kv_heads)  # SmolLM2's vocabulary, its tokenizer
    ids = [[5, 17, 99, 3, 42], [7, 7, 7]]
    outs = {}
    for size in (1, tp):
        with _engine(model_path=path, tokenizer_path=default_model_path, tp_size=size, max_total_tokens=512,
                     num_threads=1, **({} if quant == "none" else {"quantization": quant})) as eng:
            outs[size] = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                                      "ignore_eos": True}, return_logprob=True)
            # a constrained request: every rank compiles its grammar and they agree on when it is ready
            outs[size, "regex"] = eng.generate(input_ids=ids[0], sampling_params={
                "max_new_tokens": 12, "temperature": 0.0, "regex": "[a-z]{3,6}"})["text"]
    assert outs[1, "regex"] == outs[tp, "regex"] and re.fullmatch("[a-z]{3,6}", outs[tp, "regex"])
    for a, b in zip(outs[1], outs[tp]):
        assert len(a["output_ids"]) == len(b["output_ids"]) == 4
        assert a["output_ids"][0] == b["output_ids"][0]
        (lp_a, _), (lp_b, _) = a["meta_info"]["output_token_logprobs"][0], b["meta_info"]["output_token_logprobs"][0]
        assert abs(lp_a - lp_b) < 1e-3


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match=r"attention heads \(9\) is not divisible by tp_size \(2\)"):
        _engine(tp_size=2, max_total_tokens=1024)


def test_server_args_bounds() -> None:
    from radixserve.server_args import ServerArgs

    for kw, field in (({"tp_size": 10**6}, "tp_size"), ({"tp_size": 0}, "tp_size")):
        with pytest.raises(ValueError, match=field):
            ServerArgs(**kw)
    ServerArgs(tp_size=3, quantization="int4")  # low-bit weights shard like the float ones


def test_low_bit_shards_are_the_float_shards(default_model_path) -> None:
    """--quantization auto at tp 3: each rank's low-bit copy is cut from the file's own blocks by the
    layer's tp_slice (the rule its float weights are loaded by), so it dequantises to exactly the float
    shard the rank holds: column (qkv with q and kv heads, gate/up), row (o, down: K split on block
    boundaries) and vocabulary-parallel (the tied LM head). Built in-process: loading needs no group."""
    from radixserve.distributed.parallel_state import ParallelState
    from radixserve.layers.linear import PackableLinear
    from radixserve.model_loader import get_model_config, iterate_weights
    from radixserve.model_loader.gguf_loader import load_gguf_low_bit
    from radixserve.models.registry import get_model_class

    cfg = get_model_config(default_model_path)
    for rank in (0, 2):
        ps = ParallelState(tp_rank=rank, tp_size=3)
        floats = get_model_class(cfg.architecture)(cfg, ps)
        floats.load_weights(iterate_weights(default_model_path))
        float_mods = dict(floats.named_modules())
        # the mapped path: each rank's blocks cut straight from the file, its float weights never loaded
        model = get_model_class(cfg.architecture)(cfg, ps)
        report = load_gguf_low_bit(model, default_model_path, "auto", None, None)
        assert report.counts == {"Q4_1": 4 * 30, "Q8_0": 1} and not report.requantized
        emb, femb = model.model.embed_tokens, floats.model.embed_tokens
        local = torch.arange(emb.blocks.shape[0])  # this rank's vocabulary rows, read in place from the file
        assert emb.weight is None and torch.equal(emb._lookup(local), femb.weight[: len(local)])
        for name, mod in model.named_modules():
            if isinstance(mod, PackableLinear):
                assert mod.weight is None
                want = float_mods[name].weight
                assert torch.equal(mod.qweight.dequantize(), want), (rank, name)
