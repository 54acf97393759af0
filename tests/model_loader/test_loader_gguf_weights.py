"""GGUF weights: every supported tensor type, name mapping and q/k un-permutation, on tiny files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.model_loader import get_model_config, iterate_weights
from radixserve.model_loader.gguf_names import unpermute_rows

QT = gguf.GGMLQuantizationType


def load(path) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in iterate_weights(str(path))}


# --- architectures and the q/k permutation ------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "tied", "expected_arch"),
    [
        ("llama", True, "LlamaForCausalLM"),
        ("llama", False, "LlamaForCausalLM"),
        ("mistral", False, "MistralForCausalLM"),
        ("qwen2", True, "Qwen2ForCausalLM"),
    ],
)
def test_float32_model_round_trips_exactly(tiny_gguf, arch: str, tied: bool, expected_arch: str) -> None:
    # kv_heads != heads so q and k are un-permuted with different head counts.
    m = tiny_gguf(arch=arch, tied=tied, heads=4, kv_heads=2)
    weights = load(m.path)
    assert set(weights) == set(m.hf_weights)
    for name, expected in m.hf_weights.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
    cfg = get_model_config(str(m.path))
    assert cfg.architecture == expected_arch
    assert cfg.tie_word_embeddings is tied
    assert cfg.attention_bias is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) is (arch == "qwen2")


def test_yields_tensors_one_at_a_time(tiny_gguf) -> None:
    m = tiny_gguf()
    it = iterate_weights(str(m.path))
    name, tensor = next(it)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
    tensor.add_(1.0)  # must be writable memory of its own, not the read-only file map
    assert len(list(it)) == len(m.hf_weights) - 1


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 6),
    half_head=st.integers(1, 5),
    cols=st.sampled_from([(), (3,), (2, 2)]),
)
def test_unpermute_inverts_llama_cpp_permute(gguf_tools, heads: int, half_head: int, cols: tuple) -> None:
    w = np.arange(heads * half_head * 2 * int(np.prod(cols)), dtype=np.float32).reshape(
        heads * half_head * 2, *cols
    )
    permuted = gguf_tools["permute"](w, heads)
    restored = unpermute_rows(torch.from_numpy(np.ascontiguousarray(permuted)), heads)
    np.testing.assert_array_equal(restored.numpy(), w)


def test_unpermute_rejects_a_head_count_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="cannot un-permute 6 rows across 2 heads"):
        unpermute_rows(torch.zeros(6, 4), 2)


# --- types gguf can quantise: write real quantised tensors ---------------------------------------

# Worst-case |error| as a fraction of the tensor's max |value| (half a quantisation step, or a whole
# one where the format clips its top level), with a little headroom.
QUANTISABLE = {
    QT.F32: 0.0,
    QT.F16: 1e-3,
    QT.BF16: 8e-3,
    QT.Q8_0: 1 / 120,
    QT.Q5_0: 1 / 15,
    QT.Q5_1: 1 / 15,
    QT.Q4_0: 1 / 7,
    QT.Q4_1: 1 / 7,
}


@pytest.mark.parametrize("qtype", list(QUANTISABLE), ids=lambda q: q.name)
def test_quantised_types_round_trip(tiny_gguf, qtype: QT) -> None:
    m = tiny_gguf(encode=lambda _name, x: (gguf.quants.quantize(x, qtype), qtype))
    weights = load(m.path)
    assert set(weights) == set(m.hf_weights)
    for name, original in m.hf_weights.items():
        got = weights[name]
        assert got.shape == original.shape, name
        if original.ndim == 1:  # norms stay float32
            np.testing.assert_array_equal(got, original)
            continue
        # Exactly what gguf's own dequantiser makes of the stored blocks (rows are whole blocks, so
        # llama.cpp's row permutation commutes with quantisation)...
        expected = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        np.testing.assert_array_equal(got, expected.reshape(original.shape), err_msg=name)
        # ...and within the format's quantisation error of the original.
        assert np.abs(got - original).max() <= QUANTISABLE[qtype] * np.abs(original).max() + 1e-7, name


# --- K-quants: gguf cannot quantise them, so build blocks by hand --------------------------------

K_SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 32, "layers": 1}


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def constant_k_blocks(qtype: QT, d: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Super-blocks of 256 that each decode to the constant d*n (scales 1, mins 0), per the ggml layout."""
    b = len(d)

    def fill(byte: int, width: int) -> np.ndarray:
        return np.full((b, width), byte, dtype=np.uint8)

    nib = (n * 0x11).astype(np.uint8)[:, None]  # the same 4-bit quant in both nibbles
    crumb = (n * 0x55).astype(np.uint8)[:, None]  # the same 2-bit quant in all four crumbs
    zero16 = _f16_bytes(np.zeros(b))
    k_scales = np.tile(np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8), (b, 1))  # sc=1, m=0
    parts = {
        QT.Q2_K: [fill(0x01, 16), np.repeat(crumb, 64, 1), _f16_bytes(d), zero16],
        # hmask all ones means "no -4 offset"; scales pack 33 (6 bits), stored with a -32 bias.
        QT.Q3_K: [fill(0xFF, 32), np.repeat(crumb, 64, 1), fill(0x11, 8), fill(0xAA, 4), _f16_bytes(d)],
        QT.Q4_K: [_f16_bytes(d), zero16, k_scales, np.repeat(nib, 128, 1)],
        QT.Q5_K: [_f16_bytes(d), zero16, k_scales, fill(0, 32), np.repeat(nib, 128, 1)],
        # qh 0b10 in every crumb adds 32, which the format's -32 offset removes again.
        QT.Q6_K: [np.repeat(nib, 128, 1), fill(0xAA, 64), fill(0x01, 16), _f16_bytes(d)],
    }[qtype]
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    return blocks


K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_decode_hand_built_blocks(tiny_gguf, qtype: QT) -> None:
    rng = np.random.default_rng(1)
    expected: dict[str, np.ndarray] = {}
    max_q = 3 if qtype in (QT.Q2_K, QT.Q3_K) else 15

    def encode(name: str, x: np.ndarray) -> tuple[np.ndarray, QT]:
        rows, cols = x.shape
        d = rng.uniform(0.01, 0.1, rows * cols // 256).astype(np.float16)
        n = rng.integers(0, max_q + 1, rows * cols // 256)
        values = (d.astype(np.float32) * n).reshape(rows, cols // 256)
        expected[name] = np.repeat(values, 256, axis=1)  # each block is constant along its row
        return constant_k_blocks(qtype, d, n).reshape(rows, -1), qtype

    m = tiny_gguf(encode=encode, **K_SHAPE)
    weights = load(m.path)
    assert set(weights) == set(m.hf_weights)
    for name, want in expected.items():
        np.testing.assert_allclose(weights[name], want, rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_random_blocks_match_gguf(tiny_gguf, qtype: QT) -> None:
    rng = np.random.default_rng(2)
    expected: dict[str, np.ndarray] = {}
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    # Where each format keeps its f16 scale(s), so random bytes there can be replaced by sane values.
    f16_offsets = {QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}[qtype]

    def encode(name: str, x: np.ndarray) -> tuple[np.ndarray, QT]:
        rows, cols = x.shape
        blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
        for off in f16_offsets:
            blocks[:, off : off + 2] = _f16_bytes(rng.uniform(-0.1, 0.1, len(blocks)))
        raw = blocks.reshape(rows, -1)
        expected[name] = gguf.quants.dequantize(raw, qtype)
        return raw, qtype

    m = tiny_gguf(encode=encode, **K_SHAPE)
    weights = load(m.path)
    for name, want in expected.items():
        assert weights[name].shape == m.hf_weights[name].shape
        np.testing.assert_array_equal(weights[name], want, err_msg=name)
