"""The mapped embedding's Q8_0 fast paths (numpy, and the C++ embedding_q8_0 with the kernels on) give gguf's
reference values bit for bit (the default file's whole token_embd, every row)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radixserve.distributed.parallel_state import ParallelState
from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding, _q8_0_rows

needs_kernels = pytest.mark.skipif(load_cpu_ops()[0] is None, reason="no C++ kernels on this machine")


def test_q8_0_rows_are_ggufs_values_bit_for_bit(default_model_path) -> None:
    reader = gguf.GGUFReader(default_model_path)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert emb.tensor_type == gguf.GGMLQuantizationType.Q8_0
    raw = np.asarray(emb.data).reshape(int(emb.shape[1]), -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    got = _q8_0_rows(raw)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.fixture(scope="module")
def token_table(default_model_path):
    reader = gguf.GGUFReader(default_model_path)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return np.asarray(emb.data).reshape(int(emb.shape[1]), -1)


@needs_kernels
def test_the_cpp_lookup_is_the_numpy_rows_bit_for_bit(token_table) -> None:
    """embedding_q8_0 (what a mapped Q8_0 embedding runs with the kernels on) reads the file's rows in place and
    gives _q8_0_rows' values, bit for bit, for every row of the default file's table and any id order."""
    ops, _ = load_cpu_ops()
    blocks = torch.from_numpy(token_table.copy())
    everything = torch.arange(token_table.shape[0] - 1, -1, -1)
    out = torch.empty(everything.numel(), token_table.shape[1] // 34 * 32)
    ops.embedding_q8_0(blocks, everything, out)
    want = torch.from_numpy(_q8_0_rows(token_table[everything.numpy()]))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@needs_kernels
def test_the_layer_uses_it_and_agrees_with_the_numpy_path(token_table) -> None:
    ops, _ = load_cpu_ops()
    emb = VocabParallelEmbedding(token_table.shape[0], token_table.shape[1] // 34 * 32, ParallelState())
    emb.map_blocks(token_table, "Q8_0")
    ids = torch.tensor([[5, 0, token_table.shape[0] - 1], [7, 7, 12]])
    plain = emb(ids)
    emb.cpu_ops = ops
    fast = emb(ids)
    assert emb._blocks_t is not None and fast.shape == (2, 3, emb.hidden_size) and torch.equal(fast, plain)


@needs_kernels
@pytest.mark.parametrize("bad", [-1, 10**12])
def test_an_id_outside_the_table_is_refused_naming_it(token_table, bad) -> None:
    ops, _ = load_cpu_ops()
    out = torch.empty(1, token_table.shape[1] // 34 * 32)
    with pytest.raises(RuntimeError, match=f"token id {bad} outside"):
        ops.embedding_q8_0(torch.from_numpy(token_table[:10].copy()), torch.tensor([bad]), out)


@needs_kernels
def test_a_table_that_is_not_q8_0_rows_is_refused() -> None:
    ops, _ = load_cpu_ops()
    with pytest.raises(RuntimeError, match="K / 32 \\* 34"):
        ops.embedding_q8_0(torch.zeros(4, 33, dtype=torch.uint8), torch.tensor([0]), torch.empty(1, 32))
    with pytest.raises(RuntimeError, match="out must be float32"):
        ops.embedding_q8_0(torch.zeros(4, 34, dtype=torch.uint8), torch.tensor([0]), torch.empty(1, 64))
