"""Vocabulary-sharded embedding and LM head.

Rank r holds vocab rows [r*V/tp, (r+1)*V/tp). The embedding looks up only ids in its range
(others give zeros) and all-reduces; the LM head computes its slice of the logits, which the
LogitsProcessor all-gathers. The vocabulary is padded up to a multiple of tp_size.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.cpu_kernel_layer import CpuKernelLayer
from radixserve.layers.kernel_mode import step_kernels
from radixserve.layers.linear import PackableLinear

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


def _q8_0_rows(rows: np.ndarray) -> np.ndarray:
    """Q8_0 block rows (34-byte blocks: a float16 scale, 32 int8) as float32: scale x value, the product gguf's
    reference computes and as exact (an 11-bit mantissa times a 7-bit integer fits float32's 24 bits), without
    its per-call generality: a batch-1 decode step looks up one row (0.12 -> ~0.01 ms)."""
    blocks = rows.reshape(rows.shape[0], -1, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(rows.shape[0], -1)


class VocabParallelEmbedding(CpuKernelLayer):
    """The token embedding: float rows, or (map_blocks) the GGUF file's own block rows, read in place from the
    mapped file and dequantised per looked-up token. A quantised 8B model's embedding is 2 GiB as float32 and
    ~0.3 GiB in its file: the mapped rows cost no anonymous memory at all (their pages are the page cache's,
    shared by every rank and process mapping the file)."""

    weight: nn.Parameter | None

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.padded_vocab = -(-vocab_size // ps.tp_size) * ps.tp_size
        self.rows_per_rank = self.padded_vocab // ps.tp_size
        self.start = ps.tp_rank * self.rows_per_rank
        # empty, not zeros: untouched pages cost nothing until loaded (a mapped embedding never touches them)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.blocks: np.ndarray | None = None  # map_blocks: this rank's rows of the file, uint8 [rows, row bytes]
        self.blocks_qtype: gguf.GGMLQuantizationType | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = loaded[self.start : self.start + self.rows_per_rank]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()  # vocabulary padding (tp): rows that compute 0

    def map_blocks(self, raw: np.ndarray, qtype: str) -> None:
        """Look tokens up in the file's block rows `raw` (uint8 [vocab, row bytes], a view of the mapped file) of
        ggml type `qtype` ("Q8_0") instead of float rows; the float weight is dropped (it was never loaded)."""
        self.blocks = raw[self.start : self.start + self.rows_per_rank]
        self.blocks_qtype = gguf.GGMLQuantizationType[qtype]
        self.weight = None
        self._blocks_t: torch.Tensor | None = None  # the same bytes as a tensor, for the C++ lookup

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            assert self.weight is not None
            return F.embedding(ids, self.weight)
        if self.blocks_qtype == gguf.GGMLQuantizationType.Q8_0 and self.cpu_ops is not None and ids.device.type == "cpu":
            return self._lookup_q8_0_native(ids)
        flat = ids.reshape(-1).cpu().numpy()
        rows = self.blocks[flat]
        if self.blocks_qtype == gguf.GGMLQuantizationType.Q8_0:
            values = _q8_0_rows(rows)
        else:  # gguf's reference dequantisation of just these rows: the same float32 values as the whole tensor's
            values = gguf.quants.dequantize(rows, self.blocks_qtype).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(values)).view(*ids.shape, self.hidden_size).to(ids.device)

    def _lookup_q8_0_native(self, ids: torch.Tensor) -> torch.Tensor:
        """_q8_0_rows' values through the C++ kernel (embedding_q8_0), the mapped bytes read in place."""
        if self._blocks_t is None:
            with warnings.catch_warnings():  # the mapped file is read-only, and the kernel only reads it
                warnings.simplefilter("ignore", UserWarning)
                self._blocks_t = torch.from_numpy(np.ascontiguousarray(self.blocks))
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.hidden_size)
        self.cpu_ops.embedding_q8_0(self._blocks_t, flat, out)
        return out.view(*ids.shape, self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        in_range = (local >= 0) & (local < self.rows_per_rank)
        limit = self.rows_per_rank if self.blocks is None else self.blocks.shape[0]
        out = self._lookup(local.clamp(0, limit - 1))
        out = out * in_range.unsqueeze(-1)
        return self.ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Same sharding as the embedding (so tied weights share one tensor); used as a matrix."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        VocabParallelEmbedding.weight_loader(self, param, loaded, shard_id)

    def quant_cut(self, shard_id: object, rows: int) -> tuple[int, int, int, int]:
        """The embedding's vocabulary rows of this rank, zero rows past the vocabulary (padding)."""
        return 0, self.start, max(0, min(self.rows_per_rank, rows - self.start)), self.rows_per_rank

    def local_logits(self, hidden: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        # [n, hidden] @ [hidden, V/tp] -> [n, V/tp]
        return self.matmul(hidden, None, step_kernels(forward_batch))
