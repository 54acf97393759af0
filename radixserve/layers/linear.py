"""Tensor-parallel linear layers (Megatron-style column / row sharding).

    ColumnParallelLinear   W [out, in] split along out:  rank r holds rows [r*out/tp, (r+1)*out/tp)
    RowParallelLinear      W [out, in] split along in:   partial sums, all-reduced
    Merged/QKV variants    several logical matrices stacked along out, each split separately:

        qkv_proj.weight on rank r = [ q rows of r | k rows of r | v rows of r ]

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that slices the full
checkpoint tensor to this rank's part, so a rank only keeps its own shard.

On CPU in float32, `pack_linear_weights(model)` (called by ModelRunner after loading) moves every
projection to oneDNN's prepacked layout. Measured on this project's 2-core AVX2 machine, MKL's
`F.linear` streams a large weight at ~9 GB/s at one row and runs 32-row GEMMs at 20-40 GFLOP/s;
oneDNN's packed kernel reads the same weights ~2x faster at 1 row and runs 32 rows 1.3-2.3x faster,
i.e. exactly the decode shapes. The dense copy is released after packing so memory does not double.

Under --enable-deterministic-inference every matmul here (projections and the LM head alike) runs in
fixed-size row tiles (layers/batch_invariant.py: tiled_rows), so a row's result never depends on how
many other rows share the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.batch_invariant import batch_invariant_enabled, tiled_rows
from radixserve.layers.quantization.qweight import QuantWeight

LINEAR_BACKENDS = ("auto", "torch", "onednn")

# Steps of at most this many rows run on the low-bit copy (QuantWeight) when the runner enabled it.
# Measured on the 2-core AVX2 dev machine with the default model (bench one-batch): the Q4_1 / Q8_0
# kernels recompute every dot product per row, so their cost grows with the rows while oneDNN's float
# GEMM at a few rows is bound by the (4-6x larger) weight stream; they cross near 4 rows.
QUANT_MAX_ROWS = 4

# torch.ops.radixserve_cpu while a runner that enabled low-bit weights runs a forward; None otherwise.
# A context flag, not module state, so runners sharing weights never mix.
_QUANT_OPS: ContextVar[Any] = ContextVar("radixserve_quant_ops", default=None)


@contextmanager
def quant_rows_mode(ops: Any) -> Iterator[None]:
    token = _QUANT_OPS.set(ops)
    try:
        yield
    finally:
        _QUANT_OPS.reset(token)


def onednn_linear_available() -> bool:
    """True when this torch build has oneDNN's packed linear (x86 CPU wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` means oneDNN on a CPU in float32 (where it was measured faster), plain torch elsewhere."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "auto":
        ok = device.type == "cpu" and dtype == torch.float32 and onednn_linear_available()
        return "onednn" if ok else "torch"
    if backend == "onednn" and not (device.type == "cpu" and onednn_linear_available()):
        raise ValueError("linear_backend='onednn' needs a CPU device and a torch build with oneDNN")
    return backend


class PackableLinear(nn.Module):
    """The matmul shared by every projection: dense `F.linear`, or oneDNN's packed kernel once packed."""

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None
    qweight: QuantWeight | None = None  # the low-bit copy for few-row steps (layers/quantization/)

    def pack(self, release_dense: bool = True) -> None:
        """Reorder the weight into oneDNN's blocked layout (idempotent). `release_dense` frees the
        [out, in] copy; the shape stays readable through `weight_shape`."""
        if self.packed is not None:
            return
        assert self.weight is not None
        self.weight_shape = tuple(self.weight.shape)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous())
        if release_dense:
            self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ops = _QUANT_OPS.get()
        qw = self.qweight
        if ops is not None and qw is not None and x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS:
            out = x.new_empty(x.shape[0], qw.shape[0])
            ops.quant_linear(x.contiguous(), qw.kind, qw.n, qw.data, qw.d, qw.m, bias, out)
            return out
        if batch_invariant_enabled():  # deterministic inference: fixed-size row tiles
            return tiled_rows(lambda rows: self._gemm(rows, bias), x)
        return self._gemm(x, bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def weight_dims(self) -> tuple[int, int]:
        """(out, in) of this rank's weight, packed or not."""
        shape = self.weight_shape if self.weight is None else self.weight.shape
        return int(shape[0]), int(shape[1])

    def num_weight_params(self) -> int:
        out_f, in_f = self.weight_dims()
        return out_f * in_f


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight held: dense parameters, packed copies and low-bit copies (each counted once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for mod in model.modules():
        if isinstance(mod, PackableLinear) and mod.packed is not None:
            total += mod.num_weight_params() * mod.packed.element_size()
        if isinstance(mod, PackableLinear) and mod.qweight is not None:
            total += mod.qweight.nbytes()
    return total


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every PackableLinear of `model` for oneDNN; returns how many were packed now.

    A weight shared with another module (the LM head tied to the embedding) keeps its dense copy.
    """
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    count = 0
    for mod in model.modules():
        if isinstance(mod, PackableLinear) and mod.packed is None and mod.weight is not None:
            mod.pack(release_dense=owners.get(id(mod.weight), 0) <= 1)
            count += 1
    return count


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({d})")
    return n // d


class ColumnParallelLinear(PackableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, ps.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices in one GEMM (gate_proj and up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, ps: ParallelState) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ps)
        self.sizes_per_rank = [_divide(s, ps.tp_size, "output features") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        size = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.ps.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM, split by heads. KV heads are replicated when there
    are fewer of them than ranks (GQA with tp_size > num_kv_heads)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, ps: ParallelState
    ) -> None:
        tp = ps.tp_size
        self.num_heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "kv heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tp_size over kv heads")
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, ps)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rank = self.ps.tp_rank
        if shard_id == "q":
            offset, size, src_rank = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_rank = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: unknown shard {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src_rank * size, size))


class RowParallelLinear(PackableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.in_per_rank = _divide(in_features, ps.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = lambda p, w, s=None: p.data.copy_(w)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ps.all_reduce(self.matmul(x))
        # NOTE: bias after the reduce, or it would be added tp_size times.
        return out if self.bias is None else out + self.bias
