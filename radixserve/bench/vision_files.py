"""A random-weight Gemma-3-4B-shaped vision-language model as llama.cpp's pair of files, for `bench vision`.

    text    gemma3 GGUF in the Q4_K_M mix (scale_files.py's random blocks): hidden 2560, 34 layers, 8 heads of
            256 over 4 KV heads, MLP 10240, sliding window 1024, the 262,208-token vocabulary (SmolLM2's
            byte-level BPE padded, with Gemma 3's three image tokens at the end)
    mmproj  clip GGUF, projector type gemma3: SigLIP-So400m at 896 pixels (27 blocks of 1152, MLP 4304,
            14-pixel patches: 4,096 of them), the 4 x 4 average pool to 256 tokens, its norm and the projection
            to 2560, in float16 as llama.cpp's converter writes them

Both engines read the same two files; the weights are random, so only the times mean anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from radixserve.bench.scale_files import _tokenizer_fields, q4_k_m_type, random_blocks

IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


@dataclass(frozen=True)
class VisionShape:
    """The pair's sizes: Gemma-3-4B's by default (a test writes a tiny one)."""

    name: str = "gemma-3-4b"
    hidden: int = 2560
    layers: int = 34
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 256
    ffn: int = 10240
    vocab: int = 262208
    window: int = 1024
    v_hidden: int = 1152
    v_layers: int = 27
    v_heads: int = 16
    v_ffn: int = 4304
    image: int = 896
    patch: int = 14


def _text_tensors(sh: VisionShape) -> list[tuple[str, tuple[int, ...], QT | None, int]]:
    q, kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    out = [("token_embd.weight", (sh.vocab, sh.hidden), QT.Q4_K, 0)]
    for i in range(sh.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (sh.hidden,), None, i),
            (b + "attn_q.weight", (q, sh.hidden), QT.Q4_K, i),
            (b + "attn_k.weight", (kv, sh.hidden), QT.Q4_K, i),
            (b + "attn_v.weight", (kv, sh.hidden), q4_k_m_type(b + "attn_v.weight", i, sh.layers), i),
            (b + "attn_output.weight", (sh.hidden, q), QT.Q4_K, i),
            (b + "attn_q_norm.weight", (sh.head_dim,), None, i),
            (b + "attn_k_norm.weight", (sh.head_dim,), None, i),
            (b + "post_attention_norm.weight", (sh.hidden,), None, i),
            (b + "ffn_norm.weight", (sh.hidden,), None, i),
            (b + "ffn_gate.weight", (sh.ffn, sh.hidden), QT.Q4_K, i),
            (b + "ffn_up.weight", (sh.ffn, sh.hidden), QT.Q4_K, i),
            (b + "ffn_down.weight", (sh.hidden, sh.ffn), q4_k_m_type(b + "ffn_down.weight", i, sh.layers), i),
            (b + "post_ffw_norm.weight", (sh.hidden,), None, i),
        ]
    return [*out, ("output_norm.weight", (sh.hidden,), None, 0)]


def _write(
    w: gguf.GGUFWriter,
    plan: list[tuple[str, tuple[int, ...], QT | None, np.ndarray | None]],
    rng: np.random.Generator,
) -> None:
    """Tensor infos, then data one tensor at a time (memory stays at one tensor)."""
    for name, shape, qtype, _ in plan:
        if qtype in (None, QT.F32, QT.F16):
            dtype = np.dtype(np.float16 if qtype == QT.F16 else np.float32)
            w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        else:
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype, data in plan:
        if data is None and qtype in (None, QT.F32, QT.F16):
            data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(
                np.float16 if qtype == QT.F16 else np.float32
            )
        elif data is None:
            data = random_blocks(qtype, shape[-2], shape[-1], rng, tuple(shape[:-2]))
        w.write_tensor_data(data)
    w.close()


def write_text(path: str, sh: VisionShape, seed: int = 0) -> str:
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "gemma3")
    w.add_name(f"random {sh.name}-shaped Q4_K_M")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value in {
        "context_length": 131072,
        "embedding_length": sh.hidden,
        "block_count": sh.layers,
        "feed_forward_length": sh.ffn,
        "attention.head_count": sh.heads,
        "attention.head_count_kv": sh.kv_heads,
        "attention.key_length": sh.head_dim,
        "attention.value_length": sh.head_dim,
        "attention.sliding_window": sh.window,
    }.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    fields = _tokenizer_fields(sh.vocab)
    for key, value, vtype, sub in fields:
        if key == "tokenizer.ggml.tokens":  # Gemma 3's image markers at the end, as control tokens
            value = [*value[: -len(IMAGE_TOKENS)], *IMAGE_TOKENS]
        w.add_key_value(key, value, vtype, sub)
    plan = [
        (name, shape, qtype, np.ones(shape, np.float32) if qtype is None else None)
        for name, shape, qtype, _ in _text_tensors(sh)
    ]
    _write(w, plan, np.random.default_rng(seed))
    os.replace(tmp, path)
    return path


def write_mmproj(path: str, sh: VisionShape, seed: int = 1) -> str:
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    for key, value in {
        "image_size": sh.image,
        "patch_size": sh.patch,
        "embedding_length": sh.v_hidden,
        "feed_forward_length": sh.v_ffn,
        "block_count": sh.v_layers,
        "attention.head_count": sh.v_heads,
        "projection_dim": sh.hidden,
    }.items():
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    ones, zeros = np.ones(sh.v_hidden, np.float32), np.zeros(sh.v_hidden, np.float32)
    plan: list[tuple[str, tuple[int, ...], QT | None, np.ndarray | None]] = [
        ("v.patch_embd.weight", (sh.v_hidden, 3, sh.patch, sh.patch), QT.F32, None),
        ("v.patch_embd.bias", (sh.v_hidden,), QT.F32, None),
        ("v.position_embd.weight", ((sh.image // sh.patch) ** 2, sh.v_hidden), QT.F32, None),
    ]
    for i in range(sh.v_layers):
        b = f"v.blk.{i}."
        for stem in ("attn_q", "attn_k", "attn_v", "attn_out"):
            plan += [
                (b + stem + ".weight", (sh.v_hidden, sh.v_hidden), QT.F16, None),
                (b + stem + ".bias", (sh.v_hidden,), QT.F32, None),
            ]
        plan += [
            (b + "ln1.weight", (sh.v_hidden,), QT.F32, ones),
            (b + "ln1.bias", (sh.v_hidden,), QT.F32, zeros),
            (b + "ln2.weight", (sh.v_hidden,), QT.F32, ones),
            (b + "ln2.bias", (sh.v_hidden,), QT.F32, zeros),
            (b + "ffn_up.weight", (sh.v_ffn, sh.v_hidden), QT.F16, None),
            (b + "ffn_up.bias", (sh.v_ffn,), QT.F32, None),
            (b + "ffn_down.weight", (sh.v_hidden, sh.v_ffn), QT.F16, None),
            (b + "ffn_down.bias", (sh.v_hidden,), QT.F32, None),
        ]
    plan += [
        ("v.post_ln.weight", (sh.v_hidden,), QT.F32, ones),
        ("v.post_ln.bias", (sh.v_hidden,), QT.F32, zeros),
        ("mm.input_projection.weight", (sh.v_hidden, sh.hidden), QT.F16, None),
        ("mm.soft_emb_norm.weight", (sh.v_hidden,), QT.F32, ones),
    ]
    _write(w, plan, np.random.default_rng(seed))
    os.replace(tmp, path)
    return path


def vision_files(folder: str, sh: VisionShape = VisionShape()) -> tuple[str, str]:
    """(text GGUF, mmproj GGUF) of shape `sh` in `folder`, written on first use."""
    os.makedirs(folder, exist_ok=True)
    text = os.path.join(folder, f"{sh.name}-random-Q4_K_M.gguf")
    mmproj = os.path.join(folder, f"{sh.name}-mmproj-random-F16.gguf")
    return (
        text if os.path.exists(text) else write_text(text, sh),
        mmproj if os.path.exists(mmproj) else write_mmproj(mmproj, sh),
    )
