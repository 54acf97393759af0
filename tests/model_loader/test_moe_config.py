"""ModelConfig of the mixture-of-experts architectures: what each config key turns into (sparse layers,
renormalisation, the shared expert), and the refusals, each naming the key and its value."""

from __future__ import annotations

import pytest

from radixserve.distributed.rank_layout import check_model_fits
from radixserve.model_loader.model_config import ModelConfig

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 512}
QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32}


def cfg(**extra) -> ModelConfig:
    return ModelConfig.from_hf_config({**BASE, **extra})


def test_qwen3_moe_sparse_layers() -> None:
    c = cfg(**QWEN3)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert c.moe_layers == tuple(range(6)) and c.qk_norm and not c.qk_norm_full and not c.norm_topk_prob
    # transformers: sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    c = cfg(**QWEN3, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert c.moe_layers == (1, 5) and c.norm_topk_prob


def test_each_architecture_reads_its_own_keys() -> None:
    olmoe = cfg(architectures=["OlmoeForCausalLM"], num_experts=8, num_experts_per_tok=2, intermediate_size=32)
    assert olmoe.qk_norm_full and olmoe.moe_intermediate_size == 32 and not olmoe.norm_topk_prob
    mixtral = cfg(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    assert mixtral.architecture == "MixtralForCausalLM" and mixtral.norm_topk_prob  # always renormalised
    assert mixtral.moe_intermediate_size == 96
    qwen2 = cfg(architectures=["Qwen2MoeForCausalLM"], num_experts=8, num_experts_per_tok=4,
                moe_intermediate_size=16, shared_expert_intermediate_size=48)
    assert qwen2.shared_expert_intermediate_size == 48 and qwen2.attention_bias


@pytest.mark.parametrize("extra, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok \(0\)"),
    ({"num_experts": 0}, r"num_experts must be between 1 and 4096, got 0"),
    ({"num_experts": 10**12}, r"num_experts must be between 1 and 4096, got 1000000000000"),
    ({"num_experts": 512, "num_experts_per_tok": 100}, r"num_experts_per_tok \(100\) is above the 64"),
    ({"moe_intermediate_size": -1}, r"moe_intermediate_size must be >= 1"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be >= 1"),
    ({"mlp_only_layers": [6]}, r"mlp_only_layers must list layer ids in \[0, 6\)"),
    ({"num_experts": "8"}, r"'num_experts' must be an integer"),
])
def test_bad_expert_numbers_are_named(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        cfg(**{**QWEN3, **extra})


@pytest.mark.parametrize("extra, key", [
    ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 8}, "num_experts"),  # a dense architecture
    ({"architectures": ["LlamaForCausalLM"], "shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
    ({"architectures": ["OlmoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 8.0},
     "clip_qkv"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "qkv_bias": False}, "qkv_bias"),
])
def test_unimplemented_arithmetic_is_refused(extra, key) -> None:
    with pytest.raises(ValueError, match=rf"'{key}' = .* changes the arithmetic and is not implemented"):
        cfg(**extra)


def test_tp_must_divide_the_experts() -> None:
    c = cfg(**{**QWEN3, "moe_intermediate_size": 30})
    check_model_fits(c, 2, 1)
    with pytest.raises(ValueError, match=r"expert intermediate size \(30\) is not divisible by tp_size \(4\)"):
        check_model_fits(c, 4, 1)
    # expert parallel: whole experts over ep_size groups, each expert's rows over tp_size / ep_size ranks
    wide = {**BASE, **QWEN3, "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 96 * 16,
            "moe_intermediate_size": 30}
    c = ModelConfig.from_hf_config(wide)
    check_model_fits(c, 4, 1, ep_size=2)
    check_model_fits(c, 8, 1, ep_size=8)
    with pytest.raises(ValueError, match=r"expert intermediate size \(30\) is not divisible by tp_size / ep_size "
                                         r"\(8 / 2\)"):
        check_model_fits(c, 8, 1, ep_size=2)
    with pytest.raises(ValueError, match=r"the model's 8 experts are not divisible by ep_size \(16\)"):
        check_model_fits(c, 16, 1, ep_size=16)
    dense = cfg(architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"ep_size \(2\) needs a mixture-of-experts model"):
        check_model_fits(dense, 2, 1, ep_size=2)
