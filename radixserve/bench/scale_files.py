"""Random-weight GGUF files with real models' shapes in llama.cpp's Q4_K_M mix, for `bench scale`.

Random bytes with finite, small float16 scales are valid K-quant blocks, so an 8B-shaped file is written in
seconds without a float model or llama-quantize. The mix is llama.cpp's Q4_K_M rule (llama_tensor_get_type):
Q4_K everywhere, Q6_K for the LM head and for attn_v / ffn_down on the "more bits" layers (the first and last
eighth and every third in between). The tokenizer is the default model's (SmolLM2's byte-level BPE, so both
engines load it), padded with reserved control tokens up to the real model's vocabulary, so the embedding and
LM head have the real shapes and byte counts.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from radixserve.model_loader import default_model_path


@dataclass(frozen=True)
class Shape:
    """One model's text-decoder shape (HF config names)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0  # 0: hidden / heads
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    rope_theta: float = 500000.0

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, tied=True),
    Shape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256),
    # OLMoE-1B-7B: 64 experts of 1024, top-8, 16 layers (in llama.cpp's Mixtral layout: `llama` + expert tensors)
    Shape("olmoe-1b-7b", 2048, 16, 16, 16, 1024, 50304, experts=64, top_k=8, rope_theta=10000.0),
)}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers): the layers Q4_K_M gives Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, n_layers: int) -> QT:
    if name in ("output.weight",):
        return QT.Q6_K
    if any(s in name for s in (".attn_v.", ".ffn_down.", ".ffn_down_exps.")) and more_bits(layer, n_layers):
        return QT.Q6_K
    return QT.Q4_K


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator, lead: tuple[int, ...] = ()) -> np.ndarray:
    """uint8 [*lead, rows, row bytes] of valid `qtype` blocks: random quants and sub-scales, float16 super-scales
    drawn so a weight is ~0.01 (finite everywhere, activations stay finite through the layers)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block_elems
    raw = rng.integers(0, 256, size=(*lead, rows, nb, block_bytes), dtype=np.uint8)
    n = raw[..., 0].size
    if qtype == QT.Q4_K:  # d, dmin at bytes 0-3; w = d * sc * q - dmin * m, sc, m < 64, q < 16
        raw[..., 0:2] = rng.uniform(1e-5, 4e-5, n).astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
        raw[..., 2:4] = rng.uniform(1e-5, 4e-5, n).astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    elif qtype == QT.Q6_K:  # d at bytes 208-209; w = d * sc * (q - 32), sc int8
        raw[..., 208:210] = rng.uniform(5e-6, 2e-5, n).astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    else:
        raise ValueError(f"random_blocks: {qtype.name} is not a type of the Q4_K_M mix")
    return raw.reshape(*lead, rows, nb * block_bytes)


TokenizerField = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.lru_cache(maxsize=1)
def default_tokenizer_fields() -> tuple[TokenizerField, ...]:
    """The default model's tokenizer metadata (SmolLM2: 49,152 tokens; no chat template), to copy into random
    files (bench scale, bench moe): read once per process (2.8 s of parsing; every file copies the same fields)."""
    reader = gguf.GGUFReader(default_model_path())
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return tuple(out)


RESERVED_CONTROL = 256  # Llama 3's reserved special tokens: the last 256 ids of its 128,256


def _tokenizer_fields(vocab: int) -> list[TokenizerField]:
    """default_tokenizer_fields() with its per-token lists padded to `vocab` as a real large vocabulary is: normal
    tokens, then (like Llama 3) up to 256 reserved control tokens. Not all control: transformers keeps every
    control token as an added token, and 79,000 of them made the tokenizer alone take ~6 s to load, which no real
    model's does."""
    fields = default_tokenizer_fields()
    tokens = next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    extra = vocab - len(tokens)
    if extra < 0:
        raise ValueError(f"vocabulary {vocab} is smaller than the template's {len(tokens)}")
    control = min(extra, RESERVED_CONTROL)
    normal = extra - control
    pad = {"tokenizer.ggml.tokens": [f"<|pad_{i}|>" for i in range(normal)] +
                                    [f"<|reserved_{i}|>" for i in range(control)],
           # NORMAL pads are never produced by the merges; CONTROL (3) tokens are never split out of text
           "tokenizer.ggml.token_type": [1] * normal + [3] * control,
           "tokenizer.ggml.scores": [0.0] * extra}
    return [(key, value + pad[key] if key in pad else value, vtype, sub) for key, value, vtype, sub in fields]


def _tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...], QT | None, int]]:
    """(name, numpy-order shape, type or None for float32 norms, layer) in file order."""
    h, q, kv = s.hidden, s.heads * s.hd, s.kv_heads * s.hd
    yield "token_embd.weight", (s.vocab, h), QT.Q4_K, 0
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), None, i
        yield b + "attn_q.weight", (q, h), QT.Q4_K, i
        yield b + "attn_k.weight", (kv, h), QT.Q4_K, i
        yield b + "attn_v.weight", (kv, h), q4_k_m_type(b + "attn_v.weight", i, s.layers), i
        yield b + "attn_output.weight", (h, q), QT.Q4_K, i
        yield b + "ffn_norm.weight", (h,), None, i
        if s.experts:
            yield b + "ffn_gate_inp.weight", (s.experts, h), None, i  # llama.cpp keeps the router float32
            for part, shape in (("gate", (s.experts, s.intermediate, h)), ("up", (s.experts, s.intermediate, h)),
                                ("down", (s.experts, h, s.intermediate))):
                name = f"{b}ffn_{part}_exps.weight"
                yield name, shape, q4_k_m_type(name, i, s.layers), i
        else:
            yield b + "ffn_gate.weight", (s.intermediate, h), QT.Q4_K, i
            yield b + "ffn_up.weight", (s.intermediate, h), QT.Q4_K, i
            yield b + "ffn_down.weight", (h, s.intermediate), q4_k_m_type(b + "ffn_down.weight", i, s.layers), i
    yield "output_norm.weight", (h,), None, 0
    if not s.tied:
        yield "output.weight", (s.vocab, h), QT.Q6_K, 0


def write_scale_gguf(s: Shape, path: str, seed: int = 0) -> str:
    """Write `s` as a random Q4_K_M GGUF at `path` (tensor by tensor: memory stays at one tensor) and return it."""
    rng = np.random.default_rng(seed)
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"random {s.name} Q4_K_M")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value in {"context_length": 131072, "embedding_length": s.hidden, "block_count": s.layers,
                       "feed_forward_length": s.intermediate, "attention.head_count": s.heads,
                       "attention.head_count_kv": s.kv_heads, "rope.dimension_count": s.hd, "vocab_size": s.vocab,
                       **({"expert_count": s.experts, "expert_used_count": s.top_k} if s.experts else {})}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", s.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value, vtype, sub in _tokenizer_fields(s.vocab):
        w.add_key_value(key, value, vtype, sub)
    plan = list(_tensors(s))
    for name, shape, qtype, _ in plan:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)  # gguf turns it into elements
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype, _ in plan:
        if qtype is None:
            data = np.ones(shape, dtype=np.float32) if name.endswith("norm.weight") else \
                (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        else:
            data = random_blocks(qtype, shape[-2], shape[-1], rng, tuple(shape[:-2]))
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)
    return path


def scale_file(name: str, folder: str) -> str:
    """The file of shape `name` in `folder`, written on first use."""
    s = SHAPES[name]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{s.name}-random-v2-Q4_K_M.gguf")  # v2: the realistic tokenizer
    return path if os.path.exists(path) else write_scale_gguf(s, path)
