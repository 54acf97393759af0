"""The LoRA knobs' validation (called from ServerArgs.__post_init__: one place for every rule)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from radixserve.lora.lora_config import parse_lora_paths

MAX_LORA_RANK = 1024
MAX_LOADED_LORAS = 1024


def check_lora_args(args: Any, bad: Callable[[str, str], None]) -> None:
    if args.lora_paths is not None and not isinstance(args.lora_paths, tuple):
        object.__setattr__(args, "lora_paths", tuple(args.lora_paths))  # the CLI gives a list; frozen: once, here
    try:
        parse_lora_paths(args.lora_paths)  # names checked there (lora_config.check_adapter_name)
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
    if args.enable_lora and args.pp_size > 1:
        bad("enable_lora", f"LoRA adapters with pipeline parallelism are not supported (got pp_size {args.pp_size}); "
            "tensor parallelism (--tp-size) is")
    if args.enable_lora and args.speculative_algorithm == "draft_model":
        bad("enable_lora", "LoRA adapters with --speculative-algorithm draft_model are not supported (the draft "
            "model has no adapters); ngram drafting is")
    if args.lora_dir is not None and not os.path.isdir(args.lora_dir):
        bad("lora_dir", f"{args.lora_dir!r} is not a folder")
