"""How a ModelRunner gets its LoRAManager (kept here so model_runner.py only calls one function)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.lora.lora_batch import LoRABatch
from radixserve.lora.lora_manager import LoRAManager, parse_lora_paths

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_lora_manager(runner: ModelRunner) -> LoRAManager | None:
    args = runner.server_args
    if not args.enable_lora:
        return None
    return LoRAManager(runner.model, parse_lora_paths(args.lora_paths), args.max_lora_rank,
                       args.max_loaded_loras, runner.act_dtype, runner.device, runner.parallel_state)


def lora_batch_for(runner: ModelRunner, forward_batch: ForwardBatch) -> LoRABatch | None:
    """This step's adapter groups, or None (base-only: the step runs exactly as without LoRA). A LoRA step
    runs layer by layer: the native decode stack has no LoRA deltas (said once in the log)."""
    manager = runner.lora_manager
    if manager is None:
        return None
    batch = manager.batch_for(forward_batch)
    if batch is not None and runner.cpu_graph_runner is not None and not manager.said_layer_by_layer:
        manager.said_layer_by_layer = True
        logger.info("LoRA: steps with adapter rows run layer by layer (the native decode stack has no LoRA "
                    "deltas); base-only steps keep the native decode stack")
    return batch
