"""How a ModelRunner gets its LoRAManager (kept here so model_runner.py only calls one function)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.lora.lora_manager import LoRAManager, parse_lora_paths

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_lora_manager(runner: ModelRunner) -> LoRAManager | None:
    args = runner.server_args
    if not args.enable_lora:
        return None
    manager = LoRAManager(runner.model, parse_lora_paths(args.lora_paths), args.max_lora_rank,
                          args.max_loaded_loras, runner.dtype, runner.device)
    if runner.cpu_graph_runner is not None:
        logger.info("LoRA: steps with adapter rows run layer by layer (the native decode stack has no LoRA "
                    "deltas); base-only steps keep the native decode stack")
    return manager
