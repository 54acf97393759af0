"""Hugging Face folders: tiny random transformers models saved with save_pretrained, single and sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.model_loader import get_model_config, get_tokenizer, iterate_weights

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def save_tiny(folder: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides) -> dict:
    """Save a random tiny model to `folder`; returns the tensors save_pretrained wrote (tied ones dropped)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    shard_size = overrides.pop("max_shard_size", "50GB")
    torch.manual_seed(0)
    model = model_cls(config_cls(**(TINY | overrides))).to(dtype)
    model.save_pretrained(folder, max_shard_size=shard_size)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def assert_same_weights(folder: Path, state: dict) -> None:
    loaded = dict(iterate_weights(str(folder)))
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, state[name].to(torch.float32)), name


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny(folder, tie_word_embeddings=False)


def test_llama_single_file(llama_folder: tuple[Path, dict]) -> None:
    folder, state = llama_folder
    assert (folder / "model.safetensors").is_file()
    assert_same_weights(folder, state)
    cfg = get_model_config(str(folder))
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (32, 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 8, 64)
    assert cfg.context_len == 256 and cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_sharded(tmp_path: Path) -> None:
    state = save_tiny(tmp_path, tie_word_embeddings=False, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_weights(tmp_path, state)


def test_qwen2_tied_bf16(tmp_path: Path) -> None:
    state = save_tiny(tmp_path, arch="qwen2", dtype=torch.bfloat16, tie_word_embeddings=True)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    assert_same_weights(tmp_path, state)  # bf16 on disk, float32 out
    cfg = get_model_config(str(tmp_path))
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.attention_bias is True  # Qwen2's config has no attention_bias key
    assert cfg.tie_word_embeddings is True


def test_llama3_rope_and_eos_sources(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= {"original_max_position_embeddings": 128, "rope_theta": 500000.0}
    save_tiny(tmp_path, rope_parameters=rope, eos_token_id=[2, 3])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    cfg = get_model_config(str(tmp_path), context_length=1024)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert cfg.eos_token_ids == (2, 3, 5)
    assert cfg.context_len == 1024


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory, llama_folder: tuple[Path, dict]) -> Path:
    """The tiny llama folder plus a small word-level fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder, _ = llama_folder
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<|user|>", "hello", "world", "again"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = "{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)
    return folder


def test_hf_tokenizer(tokenizer_folder: Path) -> None:
    tok = get_tokenizer(str(tokenizer_folder))
    assert tok.is_fast
    assert tok.encode("hello world again", add_special_tokens=False) == [4, 5, 6]
    assert tok.decode([4, 5, 6]) == "hello world again"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered == "<|user|> hello"
    assert get_tokenizer("unused-model-path", tokenizer_path=str(tokenizer_folder)) is tok


def test_eos_from_tokenizer_config(tokenizer_folder: Path) -> None:
    config = json.loads((tokenizer_folder / "config.json").read_text())
    (tokenizer_folder / "config.json").write_text(json.dumps(config | {"eos_token_id": 3}))
    try:
        assert get_model_config(str(tokenizer_folder)).eos_token_ids == (3, 2)  # 2 is "</s>" in the tokenizer
    finally:
        (tokenizer_folder / "config.json").write_text(json.dumps(config))


# --- errors ---------------------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"config\.json does not exist"):
        get_model_config(str(tmp_path))


def test_no_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="no weight files in .*model.safetensors"):
        iterate_weights(str(tmp_path))


def test_missing_shard(tmp_path: Path) -> None:
    save_tiny(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = max(index["weight_map"].values())
    (tmp_path / victim).unlink()
    with pytest.raises(ValueError, match=rf"shard {victim} named by .*index.json does not exist"):
        iterate_weights(str(tmp_path))


@pytest.mark.parametrize("keep", [0.9, 0.01])
def test_truncated_safetensors(tmp_path: Path, keep: float) -> None:
    save_tiny(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or not a safetensors file"):
        iterate_weights(str(tmp_path))


def test_quantised_checkpoint_refused(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantised checkpoints \(gptq\) are not supported"):
        get_model_config(str(tmp_path))
