"""Vocabulary-sharded embedding and LM head.

Rank r holds vocab rows [r*V/tp, (r+1)*V/tp). The embedding looks up only ids in its range
(others give zeros) and all-reduces; the LM head computes its slice of the logits, which the
LogitsProcessor all-gathers. The vocabulary is padded up to a multiple of tp_size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.kernel_mode import step_kernels
from radixserve.layers.linear import PackableLinear
from radixserve.layers.quantization.qweight import QuantRows

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // ps.tp_size) * ps.tp_size
        self.rows_per_rank = self.padded_vocab // ps.tp_size
        self.start = ps.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = loaded[self.start : self.start + self.rows_per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_range = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out * in_range.unsqueeze(-1)
        return self.ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Same sharding as the embedding (so tied weights share one tensor); used as a matrix."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        VocabParallelEmbedding.weight_loader(self, param, loaded, shard_id)

    def shard_quant_rows(self, rows: QuantRows, shard_id: object = None, name: str = "weight") -> QuantRows:
        """The embedding's vocabulary rows of this rank, zero rows past the vocabulary (padding)."""
        part = rows.narrow(0, self.start, max(0, min(self.rows_per_rank, rows.q.shape[0] - self.start)), name)
        return part.pad_rows(self.rows_per_rank)

    def local_logits(self, hidden: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        # [n, hidden] @ [hidden, V/tp] -> [n, V/tp]
        return self.matmul(hidden, None, step_kernels(forward_batch))
