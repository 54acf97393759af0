"""Load a GGUF model without a float32 pass: low-bit blocks straight from the mapped file to the kernel layout.

    1. the model is built with empty (untouched, so unallocated) float parameters;
    2. the planner (layers/quantization/plan.py) packs each projection, expert layer and LM head from the file's
       blocks (GGUFBlocks: views of the mapped file), one layer at a time, and its float parameter is dropped
       before it is ever written; layers that are re-quantised (IQ2 and the like, or --quantization int8/int4)
       are dequantised from the file one layer at a time;
    3. a quantised embedding is looked up in the mapped file's rows (VocabParallelEmbedding.map_blocks);
    4. only what is left (norms, biases, float-typed tensors) is dequantised and loaded;
    5. where long steps run on float GEMMs (the opt-in --quant-max-rows), their float copy is built layer by
       layer from the file and packed at once, when the memory budget has room for it.

Peak memory while loading is the final resident size plus one layer's working set. On a later start the packed
layers are mapped from the weight cache (model_loader/weight_cache.py) instead: step 2 then reads nothing but what
the cache left out.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.linear import PackableLinear, prepare_float_weight
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.gguf_formats import FORMATS
from radixserve.layers.quantization.plan import QuantReport, quantize_model
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.model_executor.memory_budget import gib
from radixserve.model_loader.gguf import GGUFBlocks, iterate_gguf_weights
from radixserve.model_loader.weight_cache import WeightCache, packed_bytes

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"


def _float_dense(blocks: GGUFBlocks, sources: Callable[[str], list[tuple[str, object]]]):
    """dense(name, module) for the planner: this rank's float weights of one layer, dequantised from the file and
    cut by the layer's own weight loader (the one sharding rule), never kept."""

    def dense(name: str, mod: nn.Module) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(mod, FusedMoE):
            w13 = nn.Parameter(torch.empty(mod.num_local, 2 * mod.inter_per_rank, mod.hidden_size), requires_grad=False)
            w2 = nn.Parameter(torch.empty(mod.num_local, mod.hidden_size, mod.inter_per_rank), requires_grad=False)
            keep13, keep2, loaded = mod.w13, mod.w2, set(mod.loaded)
            mod.w13, mod.w2 = w13, w2
            try:
                for part in ("gate", "up", "down"):
                    mod.weight_loader(w2 if part == "down" else w13, blocks.dense(f"{name}.{part}_proj.weight"),
                                      (None, part))
            finally:
                mod.w13, mod.w2, mod.loaded = keep13, keep2, loaded
            return w13.data, w2.data
        assert isinstance(mod, PackableLinear)
        out_f, in_f = mod.weight_dims()
        holder = nn.Parameter(torch.empty(out_f, in_f), requires_grad=False)
        for src, sid in sources(name):
            mod.weight_loader(holder, blocks.dense(src), sid)
        return holder.data

    return dense


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, (PackableLinear, FusedMoE)) and id(mod) not in seen:
            seen.add(id(mod))
            out.append((name, mod))
    return out


def estimate_weight_bytes(model: nn.Module, blocks: GGUFBlocks, mode: str, float_bytes: int) -> int:
    """This rank's weight bytes once loaded in `mode`, from the file's types and the model's (unallocated)
    shapes: the budget's check before anything is read."""
    sources = model.checkpoint_sources
    low_bit = {"int8": FORMATS["Q8_0"], "int4": FORMATS["Q4_1"]}.get(mode)
    total, counted = 0, set()

    def fmt_of(srcs: list[str]):
        """(the format the kernels hold these sources in, whether its scales are the file's own)."""
        fmts = [FORMATS[blocks.qtype(s)] for s in srcs if s in blocks]
        if low_bit is not None:
            return low_bit, False  # quantised at load: float32 scales
        if mode == "none" or not fmts or all(f.handling == "float" for f in fmts):
            return None, False
        if any(f.handling == "float" for f in fmts):
            return FORMATS["Q8_0"], False
        return max(fmts, key=lambda f: f.kernel_bytes(256)), True

    for name, mod in _layers(model):
        if isinstance(mod, FusedMoE):
            numel = mod.num_local * 3 * mod.inter_per_rank * mod.hidden_size
            fmt, own = fmt_of([f"{name}.{p}_proj.weight" for p in ("gate", "up", "down")])
        else:
            out_f, in_f = mod.weight_dims()
            numel = out_f * in_f
            fmt, own = fmt_of([s for s, _ in sources(name)])
            if mod.weight is not None:
                counted.add(id(mod.weight))
        total += numel * float_bytes if fmt is None else fmt.kernel_bytes(numel, file_scales=own)
        if isinstance(mod, FusedMoE):
            counted.update(id(p) for p in (mod.w13, mod.w2) if p is not None)
    emb = _embedding(model)
    if emb is not None and _maps_embedding(blocks, mode) and emb.weight is not None:
        counted.add(id(emb.weight))  # read in place from the mapped file: page cache, not the budget
    for p in model.parameters():
        if id(p) not in counted:
            total += p.numel() * 4
    return total


def _embedding(model: nn.Module) -> VocabParallelEmbedding | None:
    for mod in model.modules():
        if type(mod) is VocabParallelEmbedding:
            return mod
    return None


def _maps_embedding(blocks: GGUFBlocks, mode: str) -> bool:
    """A quantised embedding is read in place whenever the projections are low-bit; a float one (F16 / F32) and
    the exact mode's are loaded as float rows."""
    return mode != "none" and EMBED in blocks and FORMATS[blocks.qtype(EMBED)].handling != "float" \
        and len(blocks.shape(EMBED)) == 2


def load_gguf_low_bit(model: nn.Module, path: str, mode: str, keep: Callable[[str], bool] | None,
                      float_copy: tuple[str, torch.dtype] | None, cache: WeightCache | None = None) -> QuantReport:
    """Load `model` (built with empty parameters) from the GGUF at `path` with low-bit weights in `mode`
    (auto / int8 / int4), as the module docstring says. `keep`: the checkpoint tensors this pipeline stage
    holds. `float_copy`: (linear backend, GEMM dtype) of the float copies long steps run on, or None. `cache`:
    the packed layers of an earlier load, mapped instead of repacked (written after this load when it missed)."""
    blocks = GGUFBlocks(path)
    sources = model.checkpoint_sources
    dense = _float_dense(blocks, sources)
    layers = _layers(model)
    prepacked = cache.restore(layers) if cache is not None else {}
    report = quantize_model(model, mode, sources, dense, blocks if mode == "auto" else None, prepacked)
    report.mapped_bytes = sum(packed_bytes(p) for p in prepacked.values())
    served: dict[str, bool] = {}  # checkpoint tensor -> every consumer runs without its float rows so far
    for name, mod in layers:
        if isinstance(mod, FusedMoE):
            done = mod.has_low_bit()
            if done:
                mod.release_float()
            for p in ("gate", "up", "down"):
                served[f"{name}.{p}_proj.weight"] = served.get(f"{name}.{p}_proj.weight", True) and done
            continue
        done = mod.qweight is not None
        if done:
            mod.release_float()  # never written: its pages were never allocated
        for src, _ in sources(name):
            served[src] = served.get(src, True) and done
    emb = _embedding(model)
    if emb is not None:
        mapped = _maps_embedding(blocks, mode)
        if mapped:
            emb.map_blocks(blocks.rows(EMBED), blocks.qtype(EMBED))
        served[EMBED] = served.get(EMBED, True) and mapped
    skip = {name for name, ok in served.items() if ok}
    model.load_weights(iterate_gguf_weights(path, lambda n: n not in skip and (keep is None or keep(n))))
    if float_copy is not None:
        _make_float_copies(model, dense, *float_copy)
    _return_freed_memory()
    if cache is not None and not prepacked:  # a miss: the next start maps what this one packed
        cache.save_async(layers)
    return report


def _return_freed_memory() -> None:
    """Hand the load's freed working memory back to the system: the chunks it converted were under glibc's mmap
    threshold, so they came from the heap, which keeps freed pages resident until trimmed (~0.4 GB of an 8B)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator returns memory its own way


def float_copy_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the float copies of every low-bit layer in `dtype` (what _make_float_copies would hold)."""
    total = 0
    for _, mod in _layers(model):
        if isinstance(mod, FusedMoE):
            total += mod.num_local * 3 * mod.inter_per_rank * mod.hidden_size * 4  # experts run float32 GEMMs
        else:
            out_f, in_f = mod.weight_dims()
            total += out_f * in_f * dtype.itemsize
    return total


def _make_float_copies(model: nn.Module, dense: Callable, backend: str, dtype: torch.dtype) -> None:
    """The float weights of each low-bit layer, dequantised from the file (the exact mode's values) and prepared
    for the float GEMM at once, layer by layer: the float32 working set is one layer's."""
    for name, mod in _layers(model):
        if isinstance(mod, FusedMoE):
            if mod.has_low_bit() and not mod.has_float():
                w13, w2 = dense(name, mod)
                mod.w13 = nn.Parameter(w13, requires_grad=False)
                mod.w2 = nn.Parameter(w2, requires_grad=False)
            continue
        if mod.qweight is None or mod.weight is not None or mod.packed is not None:
            continue
        mod.weight = nn.Parameter(dense(name, mod), requires_grad=False)
        if isinstance(mod, ParallelLMHead):
            mod.weight.weight_loader = mod.weight_loader
        prepare_float_weight(mod, backend, dtype, release=True)


def load_for_runner(runner: ModelRunner, keep: Callable[[str], bool] | None) -> tuple[QuantReport, int | None]:
    """A ModelRunner's GGUF in its low-bit mode: the float copies of long steps (quant_max_rows set: bf16 GEMMs)
    only when its memory budget has room for them beside a minimal KV pool, the choice logged. Returns the
    report and the quant_max_rows the runner keeps (None: every step low-bit)."""
    budget, max_rows, float_copy = runner.memory_budget, runner.quant_max_rows, None
    if max_rows is not None:
        need = float_copy_bytes(runner.model, runner.dtype)
        if budget.float_copy_fits(need, runner._min_kv_bytes):
            float_copy, budget.float_copy = (runner.linear_backend, runner.dtype), need
            logger.info("float copy: %s of %s weights for steps over %d rows (their GEMMs are faster there)",
                        gib(need), runner.dtype, max_rows)
        else:
            logger.warning("float copy: no room for %s of %s weights in the memory budget (%s); every step runs on "
                           "the low-bit weights", gib(need), runner.dtype, budget.describe())
            max_rows = None
    cache = None
    if runner.device.type == "cpu" and not runner.server_args.disable_weight_cache:
        ps = runner.parallel_state
        cache = WeightCache.open(runner.model_path, runner.quantization, (ps.tp_size, ps.pp_size, ps.ep_size),
                                 (ps.tp_rank, ps.pp_rank), runner.model_config.vocab_size)
    report = load_gguf_low_bit(runner.model, runner.model_path, runner.quantization, keep, float_copy, cache)
    budget.weights_mapped = report.mapped_bytes
    logger.info("quantization %s: %s (%.0f MB low-bit, %.0f MB of it mapped from the weight cache)",
                runner.server_args.quantization, report.summary(), report.bytes / 2**20, report.mapped_bytes / 2**20)
    return report, max_rows
