"""Mixture-of-experts layers over real ranks (gloo): tensor parallel (every expert's intermediate dimension
cut over the ranks) and expert parallel (`ep_size`: whole experts per rank, attention still tensor-parallel)
give the one-process tokens and logprobs, in the exact mode against transformers (a shared expert; a hot
expert every token picks and a dead one none does) and in the default mode on a GGUF's own low-bit expert
blocks (the fused-experts kernel on each rank's experts). An ep_size the model or tp_size cannot take is
refused before any process starts, naming the numbers."""

from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.moe_models import make_moe_model
from tests.models.test_moe_gguf import write_moe_gguf

LAYOUTS = ({}, {"tp_size": 2}, {"tp_size": 2, "ep_size": 2})
# the other forward modes at ep 2: chunked EXTEND + MIXED steps, and n-gram TARGET_VERIFY through the experts
EP_MODES = ({"tp_size": 2, "ep_size": 2, "chunked_prefill_size": 7, "enable_mixed_chunk": True},
            {"tp_size": 2, "ep_size": 2, "speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3})
PARAMS = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [[(7 * i + 3) % 300 for i in range(24)], [5, 17, 99, 3, 42], [11, 12, 13, 14] * 5]  # repeats: n-gram drafts


def _generate(path: str, tokenizer: str, **kw) -> list[dict]:
    with radixserve.Engine(model_path=path, tokenizer_path=tokenizer, max_total_tokens=1024, num_threads=1,
                           check_invariants=True, show_progress=False, **kw) as eng:
        return eng.generate(input_ids=IDS, sampling_params=PARAMS, return_logprob=True)


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def _hf_greedy(model, ids: list[int]) -> list[int]:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch,skewed", [("qwen2_moe", False), ("qwen3_moe", True)], ids=["shared-expert", "hot-dead"])
def test_exact_mode_tp_and_ep_match_transformers(tmp_path, default_model_path, arch, skewed) -> None:
    path = tmp_path / arch
    model = make_moe_model(arch, path, skewed=skewed)
    refs = [_hf_greedy(model, ids) for ids in IDS]
    base = None
    for layout in LAYOUTS + (EP_MODES if skewed else ()):
        outs = _generate(str(path), default_model_path, quantization="none", dtype="float32", **layout)
        assert [o["output_ids"] for o in outs] == refs, layout
        if base is None:
            base = outs
        for a, b in zip(base, outs):
            assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-4, layout


def test_default_mode_on_low_bit_experts_matches_one_process(tmp_path, default_model_path) -> None:
    model = make_moe_model("qwen3_moe", tmp_path / "hf", moe_intermediate_size=64)  # 2 x 32-blocks: tp 2 cuts whole ones
    path = tmp_path / "model.gguf"
    write_moe_gguf(model, "qwen3moe", path, quant={"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"})
    # float32 for the float layers (attention here): the check is of the experts, not of bf16 rounding
    outs = {str(layout): _generate(str(path), default_model_path, dtype="float32", **layout) for layout in LAYOUTS}
    base = outs["{}"]
    for key, got in outs.items():
        for a, b in zip(base, got):
            assert a["output_ids"] == b["output_ids"], key
            # the ranks' partial sums add in another order: float rounding, not a different computation
            assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-3, key


@pytest.mark.parametrize("layout,message", [
    ({"tp_size": 2, "ep_size": 4}, r"ServerArgs.ep_size: must divide tp_size \(2\)"),
    ({"tp_size": 4, "ep_size": 3}, r"ServerArgs.ep_size: must divide tp_size \(4\)"),
    ({"tp_size": 2, "ep_size": 2, "num_experts": 3}, r"the model's 3 experts are not divisible by ep_size \(2\)"),
])
def test_an_ep_size_that_cannot_split_is_refused_before_starting(tmp_path, default_model_path, layout, message) -> None:
    layout = dict(layout)
    experts = layout.pop("num_experts", 8)
    path = tmp_path / "m"
    make_moe_model("qwen3_moe", path, num_experts=experts, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=message):
        radixserve.Engine(model_path=str(path), tokenizer_path=default_model_path, quantization="none",
                          dtype="float32", show_progress=False, **layout)
