"""One memory budget, planned at start-up before anything large is allocated.

    budget = mem_fraction_static x (memory available at start-up) / (scheduler processes on this machine)
    weights + float copy (optional) + the largest step's activations + KV pool <= budget

On a CPU "available" is the kernel's MemAvailable (free memory plus the page cache it can drop); on a GPU
the free device memory. The weights are estimated from the checkpoint before they are read (a GGUF's
low-bit blocks by their kernel layout: gguf_formats.GGUFFormat.kernel_bytes; float parameters by their
dtype), and a model whose weights and activations do not fit is refused with the sizes, never OOM-killed
half way through a load. Pages of a memory-mapped file (a GGUF embedding read in place) are the page
cache's, not the budget's. The KV pool gets what remains, capped by `cpu_kv_cache_gb` on a CPU; the float
copy for long steps (the opt-in --quant-max-rows: bf16 GEMMs) is made only when it fits beside a minimal KV pool, and the choice is
logged. `/get_server_info` reports each part (as_dict).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIN_KV_TOKENS = 512  # a pool smaller than this cannot hold one ordinary prompt: refuse rather than crawl


def available_memory() -> int:
    """Bytes this machine can still give a process (MemAvailable; free pages where /proc is absent)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class MemoryBudget:
    """What one rank may hold, by part (bytes)."""

    available: int  # at start-up, this rank's share
    fraction: float  # mem_fraction_static
    weights: int = 0  # estimate before loading; the measured size once loaded
    weights_mapped: int = 0  # of `weights`, mapped from the weight cache (page cache, shared; weight_cache.py)
    float_copy: int = 0  # the float weights kept beside the low-bit ones for long steps (0: none)
    activations: int = 0  # the largest step's working set (an estimate)
    kv_pool: int = 0  # what the KV pool got
    kv_tokens: int = 0

    @property
    def total(self) -> int:
        return int(self.available * self.fraction)

    def left(self) -> int:
        """Bytes left for the KV pool."""
        return self.total - self.weights - self.float_copy - self.activations

    def describe(self) -> str:
        return (f"weights {gib(self.weights)}, float copy {gib(self.float_copy)}, activations "
                f"{gib(self.activations)}, KV pool {gib(self.kv_pool)} of a budget of {gib(self.total)} "
                f"(mem_fraction_static {self.fraction} of {gib(self.available)} available)")

    def check_weights_fit(self, min_kv_bytes: int, what: str = "the model") -> None:
        """Refuse (ValueError with the sizes) when the weights and activations leave no room for a minimal KV
        pool. Called before the weights are read."""
        need = self.weights + self.activations + min_kv_bytes
        if need > self.total:
            raise ValueError(
                f"{what} does not fit in memory: it needs {gib(need)} (weights {gib(self.weights)}, activations "
                f"{gib(self.activations)}, a minimal KV pool {gib(min_kv_bytes)}) but the budget is "
                f"{gib(self.total)} (mem_fraction_static {self.fraction} of {gib(self.available)} available); "
                "free memory, raise --mem-fraction-static, or use a smaller model or --quantization")

    def float_copy_fits(self, nbytes: int, min_kv_bytes: int) -> bool:
        return self.weights + self.activations + nbytes + min_kv_bytes <= self.total

    def size_kv_pool(self, per_token: int, cap_bytes: int | None, fixed_tokens: int | None, page_size: int) -> int:
        """The KV pool's tokens: `fixed_tokens` (max_total_tokens) when given, if it fits; else what is left,
        capped by `cap_bytes`. Raises ValueError when a given size does not fit."""
        left = self.left()
        if fixed_tokens is not None:
            if fixed_tokens * per_token > left:
                raise ValueError(
                    f"max_total_tokens {fixed_tokens} needs a KV pool of {gib(fixed_tokens * per_token)}, but only "
                    f"{gib(max(left, 0))} are left of the memory budget after {self.describe_fixed()}")
            tokens = fixed_tokens
        else:
            usable = left if cap_bytes is None else min(left, cap_bytes)
            tokens = max(int(usable // per_token) // page_size * page_size, 4 * page_size)
        self.kv_tokens, self.kv_pool = tokens, tokens * per_token
        return tokens

    def describe_fixed(self) -> str:
        return (f"weights {gib(self.weights)}, float copy {gib(self.float_copy)} and activations "
                f"{gib(self.activations)} (budget {gib(self.total)}: mem_fraction_static {self.fraction} of "
                f"{gib(self.available)} available)")

    def as_dict(self) -> dict[str, float | int]:
        return {"available_bytes": self.available, "mem_fraction_static": self.fraction, "budget_bytes": self.total,
                "weights_bytes": self.weights, "weights_mapped_bytes": self.weights_mapped,
                "float_copy_bytes": self.float_copy,
                "activations_bytes": self.activations, "kv_pool_bytes": self.kv_pool, "kv_pool_tokens": self.kv_tokens}


def activation_bytes(tokens: int, hidden: int, intermediate: int, qkv_width: int, vocab: int, logit_rows: int,
                     elem: int = 4) -> int:
    """The largest step's working set: a layer's tensors for `tokens` rows (residual, normed input, q/k/v,
    attention output, gate/up and their product, each in `elem` bytes; the KV pool is counted apart) plus the
    logits of `logit_rows` rows (and the sampler's copies of them)."""
    per_row = 4 * hidden + 2 * qkv_width + 3 * intermediate
    return tokens * per_row * elem + 3 * logit_rows * vocab * 4


def plan_runner_memory(runner: ModelRunner, loaded: int | None = None) -> tuple[MemoryBudget, int]:
    """A ModelRunner's budget (and the bytes of a minimal KV pool), planned after its model was built with empty
    parameters and before any weight is read: a model whose weights and largest step cannot fit beside a minimal
    KV pool is refused here, with the sizes. `loaded`: the bytes of weights already held (a shared model, already
    counted out of `available`)."""
    import torch  # the module's arithmetic is torch-free (tests use it on plain numbers)

    from radixserve.model_loader import model_kind  # lazy: the loaders import this module (gib)
    from radixserve.model_loader.gguf import GGUFBlocks  # lazy: as above
    from radixserve.model_loader.gguf_loader import estimate_weight_bytes  # lazy: as above

    args, cfg = runner.server_args, runner.model_config
    if runner.device.type == "cuda":
        available = torch.cuda.mem_get_info(runner.device)[0]
    else:  # the machine's memory is shared by its scheduler processes (tp / pp ranks, dp replicas)
        available = available_memory() // runner.local_procs
    budget = MemoryBudget(available, args.mem_fraction_static)
    gguf = model_kind(runner.model_path) == "gguf" and loaded is None
    if loaded is not None:
        budget.weights = 0
    elif gguf and runner.quantization != "none":
        budget.weights = estimate_weight_bytes(runner.model, GGUFBlocks(runner.model_path), runner.quantization, 4)
    else:  # float weights are read in float32 (the activations' dtype) before any packing
        budget.weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    tp = runner.parallel_state.tp_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim // tp
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.num_experts_per_tok)) // tp
    tokens = max(args.effective_chunk_size or args.max_prefill_tokens, args.max_running_requests)
    budget.activations = activation_bytes(tokens, cfg.hidden_size, inter, qkv, cfg.vocab_size,
                                          args.max_running_requests, runner.act_dtype.itemsize)
    per_token = runner._kv_bytes_per_token()
    min_kv = per_token * max(MIN_KV_TOKENS, args.max_total_tokens or 0)
    if args.max_total_tokens and budget.weights + budget.activations + min_kv > budget.total:
        budget.size_kv_pool(per_token, None, args.max_total_tokens, args.page_size)  # raises, naming the field
    if gguf and runner.quantization == "none" and budget.weights + budget.activations + min_kv > budget.total:
        raise ValueError(
            f"the exact mode (--quantization none) needs {gib(budget.weights)} of float32 weights; "
            f"{gib(budget.total - budget.activations - min_kv)} are available to them (mem_fraction_static "
            f"{budget.fraction} of {gib(budget.available)}, less activations and a minimal KV pool); "
            "use --quantization auto")
    budget.check_weights_fit(min_kv, f"{os.path.basename(runner.model_path)} ({runner.quantization})")
    return budget, min_kv
