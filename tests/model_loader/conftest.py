"""Fixtures for the model loader tests: tiny GGUF files written on the fly.

The GGUF side is built the way llama.cpp's converter does it (its names, its q/k row permutation,
ggml's dimension order handled by gguf.GGUFWriter), independently of the loader's own tables, so a
mistake in one is not mirrored in the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

QT = gguf.GGMLQuantizationType

# HF per-layer suffix -> llama.cpp per-block stem.
_LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass
class TinyModel:
    """A tiny decoder's shape, and what was written for it."""

    arch: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    vocab: int = 96
    layers: int = 2
    tied: bool = True
    context: int = 512
    rope_theta: float = 10000.0
    path: Path | None = None
    hf_weights: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter name."""
    if hf_name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k permutation (the forward direction), on rows of any array."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_shapes(m: TinyModel) -> dict[str, tuple[int, ...]]:
    """Every HF parameter of the tiny model with its shape."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab, m.hidden)}
    for i in range(m.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (m.hidden,),
            p + "post_attention_layernorm.weight": (m.hidden,),
            p + "self_attn.q_proj.weight": (q, m.hidden),
            p + "self_attn.k_proj.weight": (kv, m.hidden),
            p + "self_attn.v_proj.weight": (kv, m.hidden),
            p + "self_attn.o_proj.weight": (m.hidden, q),
            p + "mlp.gate_proj.weight": (m.ffn, m.hidden),
            p + "mlp.up_proj.weight": (m.ffn, m.hidden),
            p + "mlp.down_proj.weight": (m.hidden, m.ffn),
        }
        if m.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
    shapes["model.norm.weight"] = (m.hidden,)
    if not m.tied:
        shapes["lm_head.weight"] = (m.vocab, m.hidden)
    return shapes


def write_gguf(
    m: TinyModel,
    path: Path,
    encode: Callable[[str, np.ndarray], tuple[np.ndarray, QT]] | None = None,
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> TinyModel:
    """Write `m` as a GGUF at `path` with random float32 weights (recorded in `m.hf_weights`).

    `encode(hf_name, hf_array)` returns the stored array (HF row order) and its ggml type; the
    default stores float32. Rows of q/k are permuted afterwards, as llama.cpp does for llama.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), m.arch)
    a = m.arch
    meta: dict[str, Any] = {
        f"{a}.context_length": m.context,
        f"{a}.embedding_length": m.hidden,
        f"{a}.block_count": m.layers,
        f"{a}.feed_forward_length": m.ffn,
        f"{a}.attention.head_count": m.heads,
        f"{a}.attention.head_count_kv": m.kv_heads,
        f"{a}.rope.freq_base": float(m.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.bos_token_id": 1,
    } | (metadata or {})
    for key, value in meta.items():
        if value is None:  # lets a test drop a default key
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    m.hf_weights = {}
    for name, shape in hf_shapes(m).items():
        value = rng.standard_normal(shape).astype(np.float32)
        stored, qtype = encode(name, value) if encode and len(shape) == 2 else (value, QT.F32)
        m.hf_weights[name] = value
        heads = {"attn_q": m.heads, "attn_k": m.kv_heads}.get(gguf_name(name).split(".")[-2])
        if heads is not None and m.arch in ("llama", "mistral"):
            stored = llama_cpp_permute(stored, heads)
        raw = None if qtype in (QT.F32, QT.F16) or stored.dtype != np.uint8 else qtype
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored), raw_dtype=raw)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    m.path = path
    return m


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Callable[..., TinyModel]:
    """Factory: `tiny_gguf(encode=..., metadata=..., **TinyModel fields)` -> written TinyModel."""
    counter = iter(range(1000))

    def build(
        encode: Callable[[str, np.ndarray], tuple[np.ndarray, QT]] | None = None,
        metadata: dict[str, Any] | None = None,
        extra_tensors: dict[str, np.ndarray] | None = None,
        **fields: Any,
    ) -> TinyModel:
        path = tmp_path / f"tiny{next(counter)}.gguf"
        return write_gguf(TinyModel(**fields), path, encode, metadata, extra_tensors)

    return build


@pytest.fixture
def gguf_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty GGUF cache folder for one test, with the cache enabled."""
    folder = tmp_path / "gguf-cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(folder))
    monkeypatch.delenv("RADIXSERVE_NO_GGUF_CACHE", raising=False)
    return folder


@pytest.fixture(scope="session")
def gguf_tools() -> dict[str, Any]:
    """The helpers above, for tests that need them directly (tests cannot import a conftest)."""
    return {"gguf_name": gguf_name, "permute": llama_cpp_permute, "hf_shapes": hf_shapes}


def _write_vocab_gguf(path: Path, arch: str, meta: dict[str, Any]) -> Path:
    """A GGUF holding `meta` (None values dropped) and one small tensor."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def write_vocab_gguf() -> Callable[[Path, str, dict[str, Any]], Path]:
    """`write_vocab_gguf(path, arch, meta)`: a GGUF holding tokenizer (or any) metadata and one tensor."""
    return _write_vocab_gguf


@pytest.fixture(scope="session")
def load_gguf_tokenizer() -> Callable[[str], Any]:
    """The GGUF tokenizer loader (disk cache included) without its per-process lru cache, so tests that load
    many small files do not evict the session's default-model tokenizer from it."""
    import os

    from radixserve.model_loader import gguf_tokenizer

    def load(path: str) -> Any:
        real = os.path.realpath(path)
        stat = os.stat(real)  # an unreadable path fails in open_gguf below, like get_tokenizer
        return gguf_tokenizer._tokenizer_cached.__wrapped__(real, stat.st_mtime_ns, stat.st_size)

    return load
