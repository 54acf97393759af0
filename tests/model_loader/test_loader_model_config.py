"""ModelConfig.from_hf_config: defaults and the several spellings configs use in the wild."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.model_loader.model_config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "vocab_size": 100,
}


def make(**changes) -> ModelConfig:
    return ModelConfig.from_hf_config({**BASE, **changes})


def test_defaults() -> None:
    cfg = make()
    assert cfg.num_key_value_heads == 8  # absent: multi-head attention
    assert cfg.head_dim == 8
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.hidden_act == "silu"
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    assert cfg.bos_token_id is None and cfg.eos_token_ids == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_explicit_and_null_head_dim() -> None:
    assert make(head_dim=16).head_dim == 16
    assert make(head_dim=None).head_dim == 8


def test_qwen2_always_has_qkv_bias() -> None:
    assert make(architectures=["Qwen2ForCausalLM"]).attention_bias is True
    assert make(attention_bias=True).attention_bias is True


def test_architecture_from_model_type() -> None:
    cfg = ModelConfig.from_hf_config({**BASE, "architectures": None, "model_type": "mistral"})
    assert cfg.architecture == "MistralForCausalLM"


@pytest.mark.parametrize(
    ("eos", "expected"), [(None, ()), (2, (2,)), ([2, 7, 2], (2, 7))]
)  # fmt: skip
def test_eos_forms(eos, expected: tuple[int, ...]) -> None:
    assert make(eos_token_id=eos).eos_token_ids == expected


@pytest.mark.parametrize(
    ("fields", "theta", "scaling"),
    [
        ({"rope_theta": 5e5}, 5e5, None),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            10000.0,
            {"rope_type": "linear", "factor": 2.0},
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            10000.0,
            {"rope_type": "linear", "factor": 2.0},
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                }
            },
            5e5,
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
        ),
        ({"rope_theta": 3.0, "rope_scaling": None}, 3.0, None),
    ],
)
def test_rope_forms(fields: dict, theta: float, scaling: dict | None) -> None:
    cfg = make(**fields)
    assert cfg.rope_theta == theta
    assert cfg.rope_scaling == scaling


def test_context_length() -> None:
    assert make().context_len == 2048
    assert make(max_position_embeddings=4096).context_len == 4096
    assert (
        ModelConfig.from_hf_config({**BASE, "max_position_embeddings": 4096}, context_length=512).context_len
        == 512
    )
    with pytest.raises(ValueError, match="must be positive"):
        ModelConfig.from_hf_config(BASE, context_length=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"vocab_size": "100"}, "'vocab_size' must be an integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"architectures": [], "model_type": "bert"}, "names no architecture"),
    ],
)
def test_invalid(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**changes)
