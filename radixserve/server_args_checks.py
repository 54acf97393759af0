"""ServerArgs' validation: every rule on the knobs, written once and run by ServerArgs.__post_init__, and the
lists of accepted values they check against (server_args.py re-exports them). Each message names the
field: `ServerArgs.<field>: <why>`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from radixserve.distributed.host_port import parse_host_port
from radixserve.function_call.registry import TOOL_CALL_PARSERS  # the one list of tool-call formats
from radixserve.lora.lora_args import check_lora_args
from radixserve.model_loader.chat_template import read_chat_template
from radixserve.parser.reasoning_args import check_reasoning_args

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

SCHEDULE_POLICIES = ("fcfs", "lpm")
API_KEY_ENV = "RADIXSERVE_API_KEY"
MAX_RANKS = 64  # tp_size * pp_size per replica: one process per rank, so an absurd value must not fork-bomb the host
MAX_DP_SIZE = 64  # replicas (each tp_size * pp_size processes): an absurd value must not fork-bomb the host
MAX_PROCESSES = 256  # scheduler processes of one server, all replicas' ranks together
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "prefix_aware")  # managers/data_parallel_controller.py
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")  # layers/quantization/plan.py says what each does
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
GRAMMAR_BACKENDS = ("xgrammar", "none")
POOLING_METHODS = ("last", "mean")  # layers/pooler.py
SPECULATIVE_ALGORITHMS = (None, "ngram", "draft_model")  # speculative/spec_info.py
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MEM_FRACTION = 0.8  # ServerArgs.mem_fraction_static's default (model_executor/memory_budget.py)


def check_hicache_args(args: ServerArgs, bad) -> None:
    """The disk tier's knobs (the directory itself is checked when the scheduler opens it)."""
    if args.enable_hierarchical_cache:
        if not args.hicache_storage_dir:
            bad("hicache_storage_dir", "--enable-hierarchical-cache needs a directory for the disk tier "
                "(--hicache-storage-dir DIR)")
        if args.disable_radix_cache:
            bad("enable_hierarchical_cache", "the disk tier sits under the radix cache; drop --disable-radix-cache")
    elif args.hicache_storage_dir:
        bad("hicache_storage_dir", "given without --enable-hierarchical-cache")
    size = args.hicache_size
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size <= 100_000:
        bad("hicache_size", f"must be in (0, 100000] GiB, got {size!r}")
    # 89,478,485: Pillow's Image.MAX_IMAGE_PIXELS, past which its own decompression-bomb check refuses first
    for name, low, high in (("max_image_bytes", 1024, 1 << 30), ("max_image_pixels", 1, 89_478_485),
                            ("max_images_per_request", 0, 1024)):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            bad(name, f"must be an integer in [{low}, {high}], got {value!r}")
    cache_mb = args.mm_encoder_cache_mb
    if isinstance(cache_mb, bool) or not isinstance(cache_mb, (int, float)) or not 0 <= cache_mb <= 65536:
        bad("mm_encoder_cache_mb", f"must be in [0, 65536] MB, got {cache_mb!r}")
    if args.mmproj is not None:
        if not os.path.isfile(args.mmproj):
            bad("mmproj", f"{args.mmproj!r} is not a file")
        if args.model_path is None or not str(args.model_path).endswith(".gguf"):
            bad("mmproj", "goes beside a text GGUF --model-path (an HF folder carries its own vision tower)")
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        bad("allowed_local_media_path", f"{args.allowed_local_media_path!r} is not a directory")
    ratio = args.swa_full_tokens_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        bad("swa_full_tokens_ratio", f"must be in (0, 1], got {ratio!r}")


def check_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the first bad field; also normalise the few values that have two spellings
    (api_key from the environment, request_timeout <= 0 = none, speculative_algorithm "none").
    ServerArgs is frozen: those are set once, here, with object.__setattr__."""
    def bad(name: str, why: str) -> None:
        raise ValueError(f"ServerArgs.{name}: {why}")

    for f in dataclasses.fields(args):  # a switch is a bool: "maybe" or 3 must not turn a feature on or off
        if f.type == "bool" and not isinstance(getattr(args, f.name), bool):
            bad(f.name, f"must be true or false, got {getattr(args, f.name)!r}")
    if args.api_key is None and os.environ.get(API_KEY_ENV):
        object.__setattr__(args, "api_key", os.environ[API_KEY_ENV])  # frozen: set once, here
    if args.request_timeout is not None and args.request_timeout <= 0:
        object.__setattr__(args, "request_timeout", None)
    for name in ("max_queued_requests", "max_request_body_bytes", "max_prompts_per_request", "max_n",
                 "max_stop_strings", "max_stop_string_len", "max_logit_bias"):
        if getattr(args, name) < 1:
            bad(name, "must be >= 1")
    if isinstance(args.max_rerank_documents, bool) or not 1 <= args.max_rerank_documents <= 100_000:
        bad("max_rerank_documents", f"must be in [1, 100000], got {args.max_rerank_documents!r}")
    if args.max_top_logprobs < 0:
        bad("max_top_logprobs", "must be >= 0")
    if isinstance(args.responses_store_size, bool) or not 1 <= args.responses_store_size <= 100_000:
        bad("responses_store_size", f"must be in [1, 100000], got {args.responses_store_size!r}")
    check_hicache_args(args, bad)
    if not args.rpc_timeout > 0 or not args.graceful_shutdown_timeout >= 0:
        bad("rpc_timeout", "rpc_timeout must be > 0 and graceful_shutdown_timeout >= 0")

    if args.dtype not in ("auto", "float32", "float16", "bfloat16"):
        bad("dtype", f"must be auto, float32, float16 or bfloat16, got {args.dtype!r}")
    if args.kv_cache_dtype in ("fp8_e5m2", "fp8"):
        bad("kv_cache_dtype", f"{args.kv_cache_dtype} is not implemented here; fp8_e4m3 (a scale per head and token) "
            "and int8 (llama.cpp's q8_0 blocks) are, read in place by the CPU kernels")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {args.kv_cache_dtype!r}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        bad("device", f"must be cpu or cuda, got {args.device!r}")
    if args.attention_backend not in ("auto", "torch_native", "cpu_paged"):
        bad("attention_backend", f"must be auto, torch_native or cpu_paged, got {args.attention_backend!r}")
    if args.linear_backend not in ("auto", "torch", "onednn"):
        bad("linear_backend", f"must be auto, torch or onednn, got {args.linear_backend!r}")
    if args.quantization not in QUANTIZATION_MODES:
        bad("quantization", f"must be auto, none, int8 or int4, got {args.quantization!r}")
    if args.quantization in ("int8", "int4") and args.device != "cpu":
        bad("quantization", f"{args.quantization} runs on the CPU (device=cpu)")
    if args.quant_max_rows is not None and not 1 <= args.quant_max_rows <= 1 << 20:
        bad("quant_max_rows", f"must be in [1, {1 << 20}] or None (auto), got {args.quant_max_rows}")
    if args.quant_max_rows is not None and args.quantization == "none":  # there is no low-bit copy to cap
        bad("quant_max_rows", "only applies to low-bit weights; with quantization=none leave it unset")
    if args.quantization in ("int8", "int4") and args.enable_deterministic_inference:
        # the low-bit path serves steps of few rows only, so a row's numbers would depend on its batch
        bad("quantization", f"{args.quantization} and enable_deterministic_inference cannot be combined")
    if args.enable_deterministic_inference:
        why = None
        if args.device != "cpu" or args.dtype not in ("auto", "float32"):
            why = f"needs device=cpu and dtype=float32 or auto (got {args.device}, {args.dtype})"
        elif args.attention_backend != "auto":  # refused: silently replacing the choice would hide it
            why = f"has its own attention kernel, so attention_backend={args.attention_backend} would be ignored"
        elif args.tp_size > 2:
            # two ranks' partial sums add in one order-free step; with more, the all-reduce's
            # summation order of an element depends on the tensor's size, i.e. on the batch
            why = f"supports tp_size <= 2 (got {args.tp_size})"
        if why:
            bad("enable_deterministic_inference", why)
    if args.page_size < 1:
        bad("page_size", "must be >= 1")
    if args.max_total_tokens is not None and args.max_total_tokens < 2 * args.page_size:
        bad("max_total_tokens", "too small to hold even one page")
    if args.max_running_requests < 1:
        bad("max_running_requests", "must be >= 1")
    if args.max_prefill_tokens < 1:
        bad("max_prefill_tokens", "must be >= 1")
    if args.schedule_policy not in SCHEDULE_POLICIES:
        bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    for name in ("tp_size", "pp_size", "dp_size", "nnodes"):
        if getattr(args, name) < 1:
            bad(name, f"must be >= 1, got {getattr(args, name)}")
    for name in ("tp_size", "pp_size"):
        if getattr(args, name) > MAX_RANKS:
            bad(name, f"must be <= {MAX_RANKS}, got {getattr(args, name)}")
    if not 1 <= args.ep_size <= args.tp_size or args.tp_size % args.ep_size:
        bad("ep_size", f"must divide tp_size ({args.tp_size}): experts are sharded across the tensor-parallel "
            f"ranks, got {args.ep_size}")
    if args.ranks_per_replica > MAX_RANKS:
        bad("pp_size", f"tp_size * pp_size must be <= {MAX_RANKS}, got {args.tp_size} * {args.pp_size}")
    if args.dp_size > MAX_DP_SIZE or args.ranks_per_replica * args.dp_size > MAX_PROCESSES:
        bad("dp_size", f"must be <= {MAX_DP_SIZE} with dp_size * tp_size * pp_size <= {MAX_PROCESSES} scheduler "
            f"processes, got dp_size {args.dp_size} x {args.ranks_per_replica} ranks")
    if args.load_balance_method not in LOAD_BALANCE_METHODS:
        bad("load_balance_method", f"must be one of {LOAD_BALANCE_METHODS}, got {args.load_balance_method!r}")
    if args.dp_size > 1 and args.device.startswith("cuda:"):
        bad("device", f"with dp_size > 1 give device=cuda (replica k takes GPUs k*tp_size ..), got {args.device!r}")
    if args.dp_size > 1 and args.nnodes > 1:
        bad("dp_size", "data parallel across machines (nnodes > 1) is not supported: run one server per "
            "machine behind a router, or dp_size 1")
    if args.ranks_per_replica % args.nnodes:
        bad("nnodes", f"tp_size * pp_size ({args.ranks_per_replica}) must be a multiple of nnodes "
            f"({args.nnodes}): every node runs the same number of ranks")
    if args.dist_init_addr is not None:
        try:
            parse_host_port(args.dist_init_addr)
        except ValueError as e:
            bad("dist_init_addr", str(e))
    elif args.nnodes > 1:
        bad("dist_init_addr", "required when nnodes > 1 (host:port of node 0, reachable from every node)")
    if not 5 <= args.dist_timeout <= 86400:
        bad("dist_timeout", f"must be in [5, 86400] seconds, got {args.dist_timeout}")
    if not 1 <= args.dist_init_timeout <= 3600:
        bad("dist_init_timeout", f"must be in [1, 3600] seconds, got {args.dist_init_timeout}")
    if isinstance(args.speculative_algorithm, str) and args.speculative_algorithm.lower() == "none":
        object.__setattr__(args, "speculative_algorithm", None)  # the CLI spells None as a string
    if args.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS}, got {args.speculative_algorithm!r}")
    if args.speculative_algorithm == "draft_model" and not args.speculative_draft_model_path:
        bad("speculative_draft_model_path", "speculative_algorithm draft_model needs a draft model path")
    if args.speculative_draft_model_path and args.speculative_algorithm != "draft_model":
        bad("speculative_draft_model_path", "is only used with speculative_algorithm draft_model, got "
            f"{args.speculative_algorithm!r}")
    if args.speculative_algorithm == "draft_model" and args.ranks_per_replica > 1:
        # each rank would draw its own drafts; the draft runner is single-rank
        bad("speculative_algorithm", f"draft_model supports one rank per replica (got tp_size {args.tp_size}, "
            f"pp_size {args.pp_size})")
    if not 1 <= args.speculative_ngram_min_match_window <= args.speculative_ngram_max_match_window <= 64:
        bad("speculative_ngram_min_match_window", "need 1 <= min <= max <= 64, got "
            f"{args.speculative_ngram_min_match_window} / {args.speculative_ngram_max_match_window}")
    if not 1 <= args.speculative_num_draft_tokens <= 16:
        bad("speculative_num_draft_tokens", f"must be in [1, 16], got {args.speculative_num_draft_tokens}")
    if args.grammar_backend not in GRAMMAR_BACKENDS:
        bad("grammar_backend", f"must be one of {GRAMMAR_BACKENDS}, got {args.grammar_backend!r}")
    if not 1 <= args.grammar_cache_size <= 100_000:
        bad("grammar_cache_size", f"must be in [1, 100000], got {args.grammar_cache_size}")
    if not 0 < args.grammar_compile_timeout <= 3600:
        bad("grammar_compile_timeout", f"must be in (0, 3600] seconds, got {args.grammar_compile_timeout}")
    check_reasoning_args(args, bad)  # parser/reasoning_args.py
    if args.tool_call_parser not in TOOL_CALL_PARSERS:
        bad("tool_call_parser", f"unknown format {args.tool_call_parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    check_lora_args(args, bad)  # lora/lora_args.py
    if args.pooling not in POOLING_METHODS:
        bad("pooling", f"must be one of {POOLING_METHODS}, got {args.pooling!r}")
    if args.is_embedding and (args.speculative_algorithm or args.pp_size > 1):  # it decodes nothing
        bad("is_embedding", "an embedding server runs no speculative decoding, and one pipeline stage "
            f"(got speculative_algorithm {args.speculative_algorithm!r}, pp_size {args.pp_size})")
    if not 0 <= args.node_rank < args.nnodes:
        bad("node_rank", f"must be in [0, nnodes={args.nnodes}), got {args.node_rank}")
    if args.context_length is not None and args.context_length < 2:
        bad("context_length", "must be >= 2")
    if not 0 < args.mem_fraction_static <= 1:
        bad("mem_fraction_static", "must be in (0, 1]")
    if args.log_level.lower() not in LOG_LEVELS:
        bad("log_level", f"must be one of {LOG_LEVELS}, got {args.log_level!r}")
    if args.chat_template is not None:  # a bad file fails the start, never a request
        read_chat_template(args.chat_template)
