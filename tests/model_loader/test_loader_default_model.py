"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF loader."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_loader import get_model_config, get_tokenizer, iterate_weights
from radixserve.model_loader.gguf_file import open_gguf


@pytest.fixture(scope="module")
def loaded(default_model_path: str, hf_oracle) -> dict[str, object]:
    """One streaming pass over our weights, compared tensor by tensor against the oracle.

    Only a summary is kept so the 135M float32 parameters are never held twice.
    """
    params = dict(hf_oracle.named_parameters())
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: set[torch.dtype] = set()
    mismatched: list[str] = []
    for name, tensor in iterate_weights(default_model_path):
        assert name not in shapes, f"{name} yielded twice"
        shapes[name] = tuple(tensor.shape)
        dtypes.add(tensor.dtype)
        ref = params.get(name)
        if ref is None or ref.shape != tensor.shape or not torch.equal(ref.detach(), tensor):
            mismatched.append(name)
    return {"params": params, "shapes": shapes, "dtypes": dtypes, "mismatched": mismatched}


def test_config(default_model_path: str) -> None:
    cfg = get_model_config(default_model_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True
    assert cfg.attention_bias is False
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.context_len == 8192
    assert cfg.hidden_act == "silu"
    assert cfg.bos_token_id == 1
    assert cfg.eos_token_ids == (2,)
    assert get_model_config(default_model_path, context_length=2048).context_len == 2048


def test_config_matches_transformers(default_model_path: str, hf_oracle) -> None:
    ours, theirs = get_model_config(default_model_path), hf_oracle.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.context_len == theirs.max_position_embeddings


def test_weight_names_match_transformers(loaded: dict) -> None:
    assert set(loaded["shapes"]) == set(loaded["params"])
    assert "lm_head.weight" not in loaded["shapes"]  # tied: transformers shares embed_tokens


def test_weight_shapes_match_transformers(loaded: dict) -> None:
    for name, shape in loaded["shapes"].items():
        assert shape == tuple(loaded["params"][name].shape), name
    assert loaded["shapes"]["model.layers.0.self_attn.k_proj.weight"] == (192, 576)  # [out, in]
    assert loaded["shapes"]["model.layers.0.mlp.down_proj.weight"] == (576, 1536)
    assert loaded["dtypes"] == {torch.float32}


def test_weight_values_match_transformers(loaded: dict) -> None:
    # Exact equality: both dequantise with gguf's code, and q/k must be un-permuted identically.
    assert loaded["mismatched"] == []


def test_default_model_holds_the_expected_tensor_types(default_model_path: str) -> None:
    types = {t.tensor_type.name for t in open_gguf(default_model_path).tensors.values()}
    assert types == {"F32", "Q4_1", "Q8_0"}


# --- tokenizer ---------------------------------------------------------------------------------

# Ids recorded from transformers 5.24's own tokenizer for this file
# (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`); building that reference live would cost a
# second multi-second GGUF parse per run.
REFERENCE_IDS = {
    "Hello world": [19556, 905],
    "  leading spaces, trailing\n\nnewlines\n": [216, 2899, 5600, 28, 35079, 198, 198, 2241, 5110, 198],
    "Unicode: naïve café, 日本語, emoji 🤖🎉": [
        3706, 15817, 42, 15486, 46494, 37366, 28, 17097, 241, 115, 40993, 179, 120, 248, 28, 649, 33777,
        15107, 114, 240, 10813, 232, 227,
    ],
    "Code: def f(x):\n\treturn x ** 2  # comment": [
        15832, 42, 753, 275, 24, 104, 727, 198, 197, 5406, 1792, 1903, 216, 34, 216, 907, 5189,
    ],
    "<|im_start|>user\nhi<|im_end|>\n": [1, 4093, 198, 6004, 2, 198],
}  # fmt: skip


def test_tokenizer_is_fast_and_cached(tokenizer, default_model_path: str) -> None:
    assert tokenizer.is_fast
    assert get_tokenizer(default_model_path) is tokenizer


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_tokenizer_matches_transformers(tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == REFERENCE_IDS[text]


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_token_strings_are_the_files_vocabulary(tokenizer, default_model_path: str) -> None:
    vocab = open_gguf(default_model_path).get("tokenizer.ggml.tokens")
    assert len(vocab) == len(tokenizer) == 49152
    for ids in REFERENCE_IDS.values():
        assert tokenizer.convert_ids_to_tokens(ids) == [vocab[i] for i in ids]


def test_tokenizer_adds_no_bos_and_knows_eos(tokenizer) -> None:
    assert tokenizer.encode("Hello world", add_special_tokens=True) == [19556, 905]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_chat_template(tokenizer, default_model_path: str) -> None:
    assert tokenizer.chat_template == open_gguf(default_model_path).get("tokenizer.chat_template")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template injects a default system turn
