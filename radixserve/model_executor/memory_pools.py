"""The runner's KV pools, sized from its memory budget: the request rows, the allocator and the K/V buffers,
one pool for every layer or a hybrid sliding-window pool (mem_cache/swa_memory_pool.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool
from radixserve.mem_cache.swa_memory_pool import SWAKVPool, SWAPlan, SWATokenToKVPoolAllocator

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _size_kv_pool(runner: ModelRunner) -> int:
    """The full pool's tokens from the budget (model_executor/memory_budget.py), alike on every rank."""
    args = runner.server_args
    cap = None if runner.device.type == "cuda" else int(args.cpu_kv_cache_gb * 2**30)
    tokens = runner.memory_budget.size_kv_pool(runner._kv_bytes_per_token(), cap, args.max_total_tokens, args.page_size)
    if runner.parallel_state.world_size > 1:
        # every rank must see the same pool (their schedulers decide identically): the smallest
        n = torch.tensor([tokens], dtype=torch.int64)
        runner.parallel_state.all_reduce_min(n)
        tokens = int(n.item())
    return tokens


def init_memory_pools(runner: ModelRunner) -> tuple[int, int, SWAPlan | None, ReqToTokenPool,
                                                   TokenToKVPoolAllocator, KVPool]:
    """(full pool tokens, sliding-window pool tokens (0: none), the hybrid plan kept, request rows, allocator,
    K/V buffers)."""
    args, cfg, plan = runner.server_args, runner.model_config, runner.swa_plan
    tokens = _size_kv_pool(runner)
    if plan is not None and plan.swa_tokens(tokens, args.page_size) >= tokens:
        logger.info("sliding-window KV pool: off (a pool of %d tokens is no longer than one request's windows)",
                    tokens)
        runner.swa_plan = plan = None  # and the budget is planned again at one pool's bytes per token
        tokens = _size_kv_pool(runner)
    logger.info("memory: %s", runner.memory_budget.describe())
    # Headroom past context_len for speculative draft tokens written before verification.
    rows = ReqToTokenPool(args.max_running_requests + 1, cfg.context_len + args.speculative_num_draft_tokens + 1,
                          runner.device)
    layers, kv_heads = len(runner.stage_layers), max(1, cfg.num_key_value_heads // runner.tp_size)
    start, dtype, device = runner.stage_layers.start, runner.kv_cache_dtype, runner.device
    if plan is None:
        allocator = TokenToKVPoolAllocator(tokens, args.page_size, device)
        pool = KVPool(allocator.size, layers, kv_heads, cfg.head_dim, dtype, device, start_layer=start)
        return tokens, 0, None, rows, allocator, pool
    size = tokens // args.page_size * args.page_size
    swa_tokens = plan.swa_tokens(tokens, args.page_size)
    # + 1: row 0 of the local pool is the reserved target of unmapped slots, as slot 0 is of the full pool
    pool = SWAKVPool(size, swa_tokens + 1, list(plan.layer_ids), layers, kv_heads, cfg.head_dim, dtype, device,
                     start_layer=start)
    allocator = SWATokenToKVPoolAllocator(size, swa_tokens + 1, args.page_size, plan.window, pool.full_to_swa, device)
    logger.info("sliding-window KV pool: %d local slots beside %d full ones", swa_tokens, size)
    return tokens, swa_tokens, plan, rows, allocator, pool
