"""How a ModelRunner gets its LoRAManager (kept here so model_runner.py only calls one function)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.lora.lora_batch import LoRABatch
from radixserve.lora.lora_dense import ROW_LIMIT
from radixserve.lora.lora_config import parse_lora_paths
from radixserve.lora.lora_manager import LoRAManager

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_lora_manager(runner: ModelRunner) -> LoRAManager | None:
    args = runner.server_args
    if not args.enable_lora:
        return None
    cpu_ops = load_cpu_ops()[0] if runner.device.type == "cpu" else None  # lora_sgmv (kernels/cpu/)
    # adapters are held in the activations' dtype (float32 on a CPU): a long step's deltas accumulate into the
    # projection's output in place (addmm_), where bf16 products would need a cast and an add, two more passes
    # over it (measured slower on AMX). lora_sgmv reads the few-row set in the float GEMMs' dtype (bf16 where
    # --dtype auto picks it: half the bytes a decode step streams; the kernel widens them exactly).
    return LoRAManager(runner.model, parse_lora_paths(args.lora_paths), args.max_lora_rank,
                       args.max_loaded_loras, runner.act_dtype, runner.device, runner.parallel_state, cpu_ops,
                       sgmv_dtype=runner.dtype)


def lora_batch_for(runner: ModelRunner, uids: list[int] | None, rows_per_req: list[int]) -> LoRABatch | None:
    """A step's adapter groups (each request's adapter uid, 0 = base, and its token rows), or None (base-only:
    the step runs exactly as without LoRA). A few-row step with adapter rows (decode, verify) runs in the
    native decode stack with the deltas inside it; a longer one runs layer by layer (said once in the log)."""
    manager = runner.lora_manager
    if manager is None:
        return None
    batch = manager.batch_for(uids, rows_per_req)
    if (batch is not None and batch.dense is None and runner.cpu_graph_runner is not None
            and not manager.said_layer_by_layer):
        manager.said_layer_by_layer = True
        logger.info("LoRA: steps of more than %d rows with adapter rows run layer by layer (segmented deltas); "
                    "shorter ones, and base-only steps, run the native decode stack", ROW_LIMIT)
    return batch
