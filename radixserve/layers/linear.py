"""Tensor-parallel linear layers (Megatron-style column / row sharding).

    ColumnParallelLinear   W [out, in] split along out:  rank r holds rows [r*out/tp, (r+1)*out/tp)
    RowParallelLinear      W [out, in] split along in:   partial sums, all-reduced
    Merged/QKV variants    several logical matrices stacked along out, each split separately:

        qkv_proj.weight on rank r = [ q rows of r | k rows of r | v rows of r ]

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that slices the full
checkpoint tensor to this rank's part, so a rank only keeps its own shard.

On CPU, `prepare_float_weights(model, ...)` (called by ModelRunner after loading) moves every
projection to oneDNN's prepacked layout. Measured on this project's 2-core AVX2 machine, MKL's
`F.linear` streams a large weight at ~9 GB/s at one row and runs 32-row GEMMs at 20-40 GFLOP/s;
oneDNN's packed kernel reads the same weights ~2x faster at 1 row and runs 32 rows 1.3-2.3x faster,
i.e. exactly the decode shapes. The dense copy is released after packing so memory does not double.

Which kernels a step runs is the runner's KernelMode (layers/kernel_mode.py), read from the ForwardBatch
each projection is called with: the low-bit copy for steps within its row cap, and under
--enable-deterministic-inference every matmul here (projections and the LM head alike) in fixed-size row
tiles (layers/batch_invariant.py: tiled_rows), so a row's result never depends on how many other rows
share the step. A call without a ForwardBatch (a caller outside a step) runs the float weights, exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import ParallelState
from radixserve.layers.batch_invariant import tiled_rows
from radixserve.layers.kernel_mode import EXACT, KernelMode, step_kernels
from radixserve.layers.quantization.qweight import QuantWeight

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch

LINEAR_BACKENDS = ("auto", "torch", "onednn")

# Which steps run on the low-bit copy (QuantWeight) when the runner has one. The integer kernels
# (kernels/cpu/csrc/quant_linear.cpp) take activation rows 4 at a time against each unpacked weight
# block. Measured: on an AVX2 Zen 3 they beat oneDNN's float32 GEMM at every row count (4-5x at 1 row,
# 1.5-2.3x at 8-128 rows, 1.3x at 512); on an AVX512-VNNI / AVX512-BF16 Zen 4 without AMX they run
# prefill and batch-64 steps as fast as oneDNN's bf16 GEMM (AVX512-BF16 dot products: ~2x float32,
# the same as the VNNI integer sums after their unpacking). So every step runs low-bit there, and the
# float copies of the quantised projections are not even kept: one kernel for every step size also
# makes a request's result independent of its batch. On AMX the long steps run AMX-INT8 tiles with the
# register tiles' bits (kernels/cpu/csrc/quant_amx.h), so there too every step is low-bit by default. A cap
# (--quant-max-rows N) is the opt-in for bf16 GEMMs above N rows: oneDNN's AMX-BF16 brgemm is ~3x the int8
# tiles at 512 rows (per-block scales cost a float step per 32 products), at the price of that invariance.


def resolve_low_bit_max_rows(setting: int | None) -> int | None:
    """ServerArgs.quant_max_rows -> the cap a runner uses: an explicit value as given, else None (every step
    low-bit, on every CPU kind)."""
    return setting or None


class LowBitHolder(nn.Module):
    """A layer other than a projection that keeps low-bit weights beside (or instead of) its float ones,
    so the model-wide rules below (release, bytes, "has floats") cover it: MoE experts (layers/moe)."""

    def has_low_bit(self) -> bool:
        raise NotImplementedError

    def has_float(self) -> bool:
        raise NotImplementedError

    def release_float(self) -> None:
        raise NotImplementedError

    def low_bit_nbytes(self) -> int:
        raise NotImplementedError


def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN's packed linear for `dtype` on this CPU (x86 CPU wheels do
    for float32; bf16 / fp16 need the CPU's native support, e.g. AVX512-BF16 / AMX, which oneDNN checks)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` means oneDNN's packed GEMM on a CPU that runs `dtype` natively in it, plain torch elsewhere."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "onednn" if device.type == "cpu" and onednn_linear_available(dtype) else "torch"
    if backend == "onednn" and not (device.type == "cpu" and onednn_linear_available(dtype)):
        raise ValueError(f"linear_backend='onednn' needs a CPU device, a torch build with oneDNN and, for {dtype}, "
                         "the CPU's native support")
    return backend


class PackableLinear(nn.Module):
    """The matmul shared by every projection: dense `F.linear`, or oneDNN's packed kernel once packed."""

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None
    qweight: QuantWeight | None = None  # the low-bit copy (layers/quantization/; which steps: KernelMode)
    # the float GEMM's dtype when it differs from the activations' (CPU bf16: float32 activations,
    # bf16 weights and GEMM on AMX); None = the input's own dtype
    gemm_dtype: torch.dtype | None = None
    gemm_weight: torch.Tensor | None = None  # a cast copy when the dense weight is shared (tied LM head)

    def pack(self, release_dense: bool = True, dtype: torch.dtype | None = None) -> None:
        """Reorder the weight (in `dtype`, default its own) into oneDNN's blocked layout (idempotent).
        `release_dense` frees the [out, in] copy; the shape stays readable through `weight_shape`."""
        if self.packed is not None:
            return
        assert self.weight is not None
        self.weight_shape = tuple(self.weight.shape)
        self.gemm_dtype = dtype if dtype is not None and dtype != self.weight.dtype else None
        w = self.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w if self.gemm_dtype is None else w.to(dtype))
        if release_dense:
            self.weight = None

    def cast(self, dtype: torch.dtype, release_dense: bool = True) -> None:
        """Plain-torch GEMMs in `dtype` (no oneDNN): the weight converted once (in place, or as a copy
        when another module shares it)."""
        assert self.weight is not None
        if self.weight.dtype == dtype:
            return
        self.gemm_dtype = dtype
        if release_dense:
            self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
        else:
            self.gemm_weight = self.weight.detach().to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, mode: KernelMode = EXACT) -> torch.Tensor:
        """x [rows, in] @ W^T (+ bias) -> [rows, out], by the kernels `mode` picks for a step of this many rows."""
        qw = self.qweight
        ops = mode.low_bit_ops(x.shape[0]) if qw is not None and x.dim() == 2 else None
        if ops is not None:
            out = x.new_empty(x.shape[0], qw.shape[0])
            ops.quant_linear(x.contiguous(), qw.kind, qw.n, qw.data, qw.d, qw.m, bias, out)
            return out
        if self.packed is None and self.weight is None:
            raise RuntimeError("this projection keeps only its low-bit copy (its float weights were released), "
                               "but the step did not run in a low-bit mode")
        if mode.batch_invariant:  # deterministic inference: fixed-size row tiles
            return tiled_rows(lambda rows: self._gemm(rows, bias), x)
        return self._gemm(x, bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dt = self.gemm_dtype
        if dt is not None and dt != x.dtype:
            # low-precision GEMM, float32 outside it: the bias is added after widening, in float32
            out = self._gemm(x.to(dt), None).to(x.dtype)
            return out if bias is None else out + bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.gemm_weight if self.gemm_weight is not None else self.weight, bias)

    def release_float(self) -> None:
        """Drop the float copy (dense and packed); the shape stays readable through `weight_shape`."""
        if self.weight is not None:
            self.weight_shape = tuple(self.weight.shape)
        self.weight, self.packed, self.gemm_weight = None, None, None

    def tp_slice(self, shard_id: object = None) -> tuple[int, int, int, int]:
        """(dim, start, length, dst): this rank's part of checkpoint tensor `shard_id` is
        loaded.narrow(dim, start, length); it goes to rows dst .. dst + length of the weight (dim 0) or
        is the whole weight (dim 1). The one sharding rule of a layer: float weights, biases and
        low-bit copies are all cut by it."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-parallel slicing")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        dim, start, length, dst = self.tp_slice(shard_id)
        src = loaded.narrow(dim, start, length)
        (param.data.narrow(0, dst, length) if dim == 0 else param.data).copy_(src)

    def quant_cut(self, shard_id: object, rows: int) -> tuple[int, int, int, int]:
        """(dim, start, length, padded rows): this rank's part of a `rows`-row checkpoint tensor's low-bit rows
        (exact GGUF blocks) is rows.narrow(dim, start, length), then zero rows up to `padded rows`; cut by
        tp_slice, like the floats."""
        ps = getattr(self, "ps", None)
        if ps is None or ps.tp_size == 1:
            return 0, 0, rows, rows
        dim, start, length, _ = self.tp_slice(shard_id)
        return dim, start, length, length if dim == 0 else rows

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
        if isinstance(mod, PackableLinear) and mod.gemm_weight is not None:
            total += mod.gemm_weight.numel() * mod.gemm_weight.element_size()
        if isinstance(mod, PackableLinear) and mod.qweight is not None:
            total += mod.qweight.nbytes()
        if isinstance(mod, LowBitHolder):
            total += mod.low_bit_nbytes()
    return total


def _weight_owners(model: nn.Module) -> dict[int, int]:
    """How many modules hold each parameter (a tied LM head shares the embedding's)."""
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


def release_float_weights(model: nn.Module) -> int:
    """Free the float weights of every projection that has a low-bit copy, for runners whose every
    step runs low-bit (resolve_low_bit_max_rows gave None); a weight another module also holds (the
    embedding of a tied LM head) stays. Returns how many were freed."""
    owners = _weight_owners(model)
    count = 0
    for mod in model.modules():
        if isinstance(mod, PackableLinear) and mod.qweight is not None and (mod.weight is not None
                                                                             or mod.packed is not None):
            if mod.weight is not None and owners.get(id(mod.weight), 0) > 1:
                continue
            mod.release_float()
            count += 1
        elif isinstance(mod, LowBitHolder) and mod.has_low_bit() and mod.has_float():
            mod.release_float()
            count += 1
    return count


def has_float_weights(model: nn.Module) -> bool:
    """False when some projection (or expert layer) kept only its low-bit copy (release_float_weights)."""
    return all(m.weight is not None or m.packed is not None for m in model.modules() if isinstance(m, PackableLinear)) \
        and all(m.has_float() for m in model.modules() if isinstance(m, LowBitHolder))


def prepare_float_weights(model: nn.Module, backend: str, dtype: torch.dtype, low_bit_only: bool = False) -> int:
    """Ready every PackableLinear's float GEMM for `backend` in `dtype`: packed for oneDNN, or cast for
    plain torch when `dtype` differs from the weights'. Returns how many were prepared now.
    low_bit_only: every step runs low-bit, so projections with a low-bit copy need no float GEMM.

    A weight shared with another module (the LM head tied to the embedding) keeps its dense copy."""
    owners = _weight_owners(model)
    count = 0
    for mod in model.modules():
        if isinstance(mod, PackableLinear) and mod.packed is None and mod.weight is not None:
            if low_bit_only and mod.qweight is not None:
                continue
            count += prepare_float_weight(mod, backend, dtype, release=owners.get(id(mod.weight), 0) <= 1)
    return count


def prepare_float_weight(mod: PackableLinear, backend: str, dtype: torch.dtype, release: bool) -> bool:
    """One projection's float GEMM readied for `backend` in `dtype` (prepare_float_weights' rule; the GGUF loader
    calls it layer by layer as it builds float copies). Returns whether anything was done."""
    assert mod.weight is not None
    if backend == "onednn":
        mod.pack(release_dense=release, dtype=dtype)
    elif mod.weight.dtype != dtype and mod.gemm_dtype is None:
        mod.cast(dtype, release_dense=release)
    else:
        return False
    return True


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

    def tp_slice(self, shard_id: object = None) -> tuple[int, int, int, int]:
        n = self.out_per_rank
        return 0, self.ps.tp_rank * n, n, 0

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.matmul(x, self.bias, step_kernels(forward_batch))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices in one GEMM (gate_proj and up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, ps: ParallelState) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ps)
        self.sizes_per_rank = [_divide(s, ps.tp_size, "output features") for s in output_sizes]

    def tp_slice(self, shard_id: object = None) -> tuple[int, int, int, int]:
        assert isinstance(shard_id, int)
        size = self.sizes_per_rank[shard_id]
        return 0, self.ps.tp_rank * size, size, sum(self.sizes_per_rank[:shard_id])


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

    def tp_slice(self, shard_id: object = None) -> tuple[int, int, int, int]:
        rank = self.ps.tp_rank
        if shard_id == "q":
            offset, size, src_rank = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_rank = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: unknown shard {shard_id!r}")
        return 0, src_rank * size, size, offset


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

    def tp_slice(self, shard_id: object = None) -> tuple[int, int, int, int]:
        n = self.in_per_rank
        return 1, self.ps.tp_rank * n, n, 0

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        out = self.ps.all_reduce(self.matmul(x, None, step_kernels(forward_batch)))
        # NOTE: bias after the reduce, or it would be added tp_size times.
        return out if self.bias is None else out + self.bias
