"""The LoRA knobs' validation (called from ServerArgs.__post_init__: one place for every rule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_LORA_RANK = 1024
MAX_LOADED_LORAS = 1024


def check_lora_args(args: Any, bad: Callable[[str, str], None]) -> None:
    from radixserve.lora.lora_config import check_adapter_name
    from radixserve.lora.lora_manager import parse_lora_paths

    if args.lora_paths is not None and not isinstance(args.lora_paths, tuple):
        object.__setattr__(args, "lora_paths", tuple(args.lora_paths))  # the CLI gives a list; frozen: once, here
    try:
        for name in parse_lora_paths(args.lora_paths):
            check_adapter_name(name)
    except ValueError as e:
        bad("lora_paths", str(e))
    if args.lora_paths and not args.enable_lora:
        object.__setattr__(args, "enable_lora", True)
    if not 1 <= args.max_lora_rank <= MAX_LORA_RANK:
        bad("max_lora_rank", f"must be in [1, {MAX_LORA_RANK}], got {args.max_lora_rank}")
    if not 1 <= args.max_loaded_loras <= MAX_LOADED_LORAS:
        bad("max_loaded_loras", f"must be in [1, {MAX_LOADED_LORAS}], got {args.max_loaded_loras}")
    if not 1 <= args.max_loras_per_batch <= args.max_loaded_loras:
        bad("max_loras_per_batch", f"must be in [1, max_loaded_loras={args.max_loaded_loras}], "
            f"got {args.max_loras_per_batch}")
    if args.enable_lora and args.ranks_per_replica > 1:
        bad("enable_lora", f"LoRA adapters run on one rank per replica for now (got tp_size {args.tp_size}, "
            f"pp_size {args.pp_size})")
    if args.enable_lora and args.speculative_algorithm is not None:
        bad("enable_lora", "LoRA adapters with speculative decoding are not supported yet")
