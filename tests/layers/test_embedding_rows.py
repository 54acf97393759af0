"""The mapped embedding's Q8_0 fast path gives gguf's reference values bit for bit (the default file's whole
token_embd, every row)."""

from __future__ import annotations

import gguf
import numpy as np

from radixserve.layers.vocab_parallel_embedding import _q8_0_rows


def test_q8_0_rows_are_ggufs_values_bit_for_bit(default_model_path) -> None:
    reader = gguf.GGUFReader(default_model_path)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert emb.tensor_type == gguf.GGMLQuantizationType.Q8_0
    raw = np.asarray(emb.data).reshape(int(emb.shape[1]), -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    got = _q8_0_rows(raw)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
