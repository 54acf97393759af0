"""ModelConfig for the architectures beyond Llama: what each config key turns into, and the refusals: an
arithmetic key the architecture does not implement, an unknown architecture, a malformed layer list."""

from __future__ import annotations

import pytest

from radixserve.model_loader.model_config import ARCH_SPECS, ModelConfig
from radixserve.model_loader.vlm_config import VISION_ARCHITECTURES
from radixserve.models.registry import MODEL_REGISTRY, get_model_class

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "vocab_size": 300, "max_position_embeddings": 512}


def cfg(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": [arch], **BASE, **extra})


def test_registry_and_specs_list_the_same_architectures() -> None:
    assert set(MODEL_REGISTRY) == set(ARCH_SPECS) | set(VISION_ARCHITECTURES)
    for name in MODEL_REGISTRY:
        assert get_model_class(name).__name__ == name


def test_gemma3_fields() -> None:
    c = cfg("Gemma3ForCausalLM", head_dim=32, sliding_window=8, query_pre_attn_scalar=16,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
            layer_types=["sliding_attention"] * 5 + ["full_attention"])
    assert [c.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert [c.layer_rope_theta(i) for i in (0, 5)] == [10000.0, 1e6]
    assert c.qk_norm and c.sandwich_norms and c.norm_offset == 1.0 and c.hidden_act == "gelu_tanh"
    assert c.scaling == 16 ** -0.5 and c.embed_scale == 8.0 and c.head_dim == 32


def test_window_spellings() -> None:
    assert cfg("MistralForCausalLM", sliding_window=4).layer_window(3) == 4
    assert cfg("MistralForCausalLM", sliding_window=None).layer_window(3) is None
    # Qwen2 writes a window but switches it off, or on from max_window_layers
    assert cfg("Qwen2ForCausalLM", sliding_window=4, use_sliding_window=False).sliding_window is None
    on = cfg("Qwen2ForCausalLM", sliding_window=4, use_sliding_window=True, max_window_layers=2)
    assert [on.layer_window(i) for i in range(6)] == [None, None, 4, 4, 4, 4]
    g2 = cfg("Gemma2ForCausalLM", sliding_window=4, head_dim=16)
    assert [g2.layer_window(i) for i in range(4)] == [4, None, 4, None]


@pytest.mark.parametrize("arch,extra,key", [
    ("LlamaForCausalLM", {"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ("Qwen3ForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("MistralForCausalLM", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("Qwen2ForCausalLM", {"num_experts": 8}, "num_experts"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unimplemented_arithmetic_keys_are_named(arch, extra, key) -> None:
    with pytest.raises(ValueError, match=key):
        cfg(arch, **extra)


@pytest.mark.parametrize("extra,match", [
    ({"hidden_act": "relu2"}, "hidden_act 'relu2'"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types must list 6"),
    ({"layer_types": ["sliding_attention"] * 6, "sliding_window": None}, "sliding_window"),
    ({"layer_types": ["chunked_attention"] * 6}, "layer_types"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be > 0"),
])
def test_malformed_values(extra, match) -> None:
    with pytest.raises(ValueError, match=match):
        cfg("Gemma2ForCausalLM", head_dim=16, **{"sliding_window": 4, **extra})


def test_unknown_architecture_lists_the_supported() -> None:
    with pytest.raises(ValueError, match=r"FooForCausalLM.*Gemma3ForCausalLM.*Qwen3ForCausalLM"):
        cfg("FooForCausalLM")
