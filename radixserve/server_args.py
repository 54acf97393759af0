"""ServerArgs: the single source of every knob.

The CLI (`radixserve serve|generate|bench ...`) is generated from the fields: a knob's default and help live here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin

from radixserve.function_call.registry import TOOL_CALL_PARSERS  # the one list of tool-call formats
from radixserve.model_loader.default_model import default_model_path
from radixserve.parser.reasoning_args import REASONING_PARSER_NAMES
from radixserve.server_args_checks import (  # re-exported: the accepted values live beside their checks
    API_KEY_ENV,
    GRAMMAR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_BALANCE_METHODS,
    LOG_LEVELS,
    MAX_DP_SIZE,
    MAX_PROCESSES,
    MAX_RANKS,
    POOLING_METHODS,
    QUANTIZATION_MODES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    check_server_args,
)
from radixserve.server_args_checks import DEFAULT_MEM_FRACTION as _DEFAULT_MEM_FRACTION

__all__ = [
    "API_KEY_ENV",
    "GRAMMAR_BACKENDS",
    "KV_CACHE_DTYPES",
    "LOAD_BALANCE_METHODS",
    "LOG_LEVELS",
    "MAX_DP_SIZE",
    "MAX_PROCESSES",
    "MAX_RANKS",
    "POOLING_METHODS",
    "QUANTIZATION_MODES",
    "SCHEDULE_POLICIES",
    "SPECULATIVE_ALGORITHMS",
    "ServerArgs",
]


def _knob(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServerArgs:
    # --- model ---
    model_path: str | None = _knob(None, "GGUF file or Hugging Face folder; None = embedded SmolLM2-135M")
    tokenizer_path: str | None = _knob(None, "tokenizer location if it differs from model_path")
    chat_template: str | None = _knob(None, "Jinja chat template file replacing the model's own (or supplying "
                                      "one, for a base model without)")
    served_model_name: str | None = _knob(
        None, "model name(s) the API answers to, comma-separated: the first is reported, the others are "
        "aliases (default: the file name; 'default' is always accepted)"
    )
    dtype: str = _knob(
        "auto", "auto | float32 | bfloat16 | float16: the GEMMs' dtype. On a CPU activations, norms, attention math "
        "and sampling stay float32 and bfloat16 means bf16 weights and GEMMs (oneDNN / AMX); on CUDA the model "
        "runs in it. auto = bfloat16 on a CPU with native bf16 matmul (AMX-BF16 or AVX512-BF16, detected at run "
        "time), else float32; on CUDA bfloat16 where supported, else float16"
    )
    kv_cache_dtype: str = _knob(
        "auto", "auto | float32 | bfloat16 | int8 | fp8_e4m3: the KV cache's storage dtype (attention computes in the activation "
        "dtype; a bf16 cache halves the bytes a decode step reads from it; int8 stores llama.cpp's q8_0 blocks, 8.5 "
        "bits a value; fp8_e4m3 e4m3 values with a float32 scale per head and token; both read in place by the CPU "
        "kernels: mem_cache/kv_quant.py). auto = the activation dtype"
    )
    device: str = _knob("cpu", "cpu | cuda")
    attention_backend: str = _knob(
        "auto", "auto | torch_native | cpu_paged (C++ kernel reading the paged KV pool in place; auto = cpu_paged "
        "on CPU float32 when it builds, else torch_native)"
    )
    linear_backend: str = _knob("auto", "auto | torch | onednn: projections' GEMM (auto = oneDNN packed on CPU float32)")
    quantization: str = _knob(
        "auto", "auto | none | int8 | int4: low-bit weights run by the C++ integer kernels with block-quantised "
        "int8 activations (which steps: quant_max_rows). auto = a GGUF's own blocks kept exactly (Q4_0..Q8_0, "
        "K-quants, IQ4; IQ1-3, TQ, MXFP4 re-quantised to Q4_1; float tensors kept float: "
        "docs/kernels_and_precision.md), "
        "none for Hugging Face folders, GPUs and deterministic mode; int8 / int4 quantise float weights at load "
        "(Q8_0 / Q4_1, 32-blocks). none = float only, the exact mode. CPU only"
    )
    disable_weight_cache: bool = _knob(
        False, "repack a GGUF's low-bit weights at every start instead of mapping the packed layers an earlier start "
        "wrote beside its config in the GGUF cache (model_loader/weight_cache.py; never more bytes than the file)")
    quant_max_rows: int | None = _knob(
        None, "with low-bit weights: steps of at most this many rows run the low-bit copy, longer ones the float "
        "weights. None = auto: every step, on every CPU kind (one precision whatever the batch: a request's tokens "
        "never depend on its neighbours; the float copies are then not kept). A cap is an opt-in for speed where "
        "bf16 GEMMs are faster (AMX: prefill 512 ~1.55x), at the price of that batch invariance"
    )
    disable_cpu_graph: bool = _knob(
        False, "run DECODE steps layer by layer in Python instead of the native decoder stack (CpuGraphRunner, "
        "used with low-bit weights for the steps they run); for debugging and comparison"
    )
    enable_deterministic_inference: bool = _knob(
        False, "batch-invariant execution: greedy and seeded requests get bit-identical tokens and logprobs "
        "whatever else shares their batch, in any order, with or without a cached prefix or chunking "
        "(fixed-size GEMM row tiles, one per-row attention kernel for every mode, per-row sampling). "
        "CPU float32 only, needs the C++ CPU kernels (start-up fails if they cannot be built); slower"
    )
    context_length: int | None = _knob(None, "override the model's context length (tokens)")
    # --- HTTP ---
    host: str = _knob("127.0.0.1", "HTTP bind address")
    port: int = _knob(30000, "HTTP port")
    api_key: str | None = _knob(
        None, "if set, every route but /health requires 'Authorization: Bearer KEY' (or set the "
        f"{API_KEY_ENV} environment variable, which keeps the key out of `ps`)"
    )
    allowed_origins: str | None = _knob(
        None, "comma-separated origins allowed by CORS (e.g. 'http://localhost:8080' or '*'); CORS is off "
        "unless set"
    )
    graceful_shutdown_timeout: float = _knob(
        30.0, "after SIGTERM, new requests get 503 while running ones may finish for this many seconds"
    )
    # --- request bounds (one request can never take the server down or stall the queue) ---
    max_queued_requests: int = _knob(
        1024, "requests in flight beyond max_running_requests; more get 429 with Retry-After"
    )
    max_request_body_bytes: int = _knob(8 * 1024 * 1024, "largest HTTP request body; larger gets 413")
    max_prompts_per_request: int = _knob(256, "most prompts in one batched call")
    max_n: int = _knob(128, "most samples per prompt (n)")
    max_top_logprobs: int = _knob(20, "most top-logprob alternatives per token (OpenAI's limit is 20)")
    max_stop_strings: int = _knob(16, "most stop strings (and, separately, stop token ids) per request")
    max_stop_string_len: int = _knob(256, "longest stop string, in characters")
    max_logit_bias: int = _knob(1024, "most logit_bias entries per request")
    max_rerank_documents: int = _knob(
        1000, "most documents in one /v1/rerank call (and text pairs in one /v1/score call); more get 400, 1..100000"
    )
    responses_store_size: int = _knob(
        1024, "responses kept in memory for GET /v1/responses/{id} and previous_response_id (the least recently "
        "used evicted; an evicted one is a 404), 1..100000"
    )
    request_timeout: float | None = _knob(
        600.0, "default per-request timeout in seconds (a request's own 'timeout' may be shorter); the "
        "request is aborted and its KV returned. None/0 = no default"
    )
    rpc_timeout: float = _knob(30.0, "seconds a control call (flush_cache, server info) waits for the scheduler")
    # --- memory ---
    max_total_tokens: int | None = _knob(None, "KV pool size in tokens (default: from the memory budget)")
    mem_fraction_static: float = _knob(_DEFAULT_MEM_FRACTION, "fraction of the memory available at start-up (CPU: RAM; GPU: free device memory) "
                                           "for weights + float copies + activations + KV pool")
    cpu_kv_cache_gb: float = _knob(2.0, "CPU: cap on the KV pool size in GiB")
    page_size: int = _knob(1, "KV slots per page; prefixes are shared in whole pages")
    swa_full_tokens_ratio: float = _knob(
        0.8, "a model with sliding-window layers (Gemma 2/3, Mistral): their own KV pool, this many slots per slot "
        "of the full layers' pool; tokens that left every window are freed from it (mem_cache/swa_memory_pool.py). "
        "(0, 1]"
    )
    disable_hybrid_swa_memory: bool = _knob(
        False, "one KV pool for every layer, sliding-window layers included (every token kept)")
    # --- images (a vision-language model: models/vision/) ---
    mmproj: str | None = _knob(
        None, "llama.cpp's vision projector file (convert_hf_to_gguf.py --mmproj) beside a text GGUF --model-path: "
        "the pair serves as one vision-language model (model_loader/mmproj.py; projector types: idefics3, gemma3, "
        "qwen2.5vl_merger)")
    allowed_local_media_path: str | None = _knob(
        None, "image inputs may name local files under this directory (resolved, symlinks included); None = no "
        "local files")
    allow_remote_media: bool = _knob(False, "image inputs may be http(s) URLs, fetched by the server (bounded by "
                                     "--max-image-bytes); off: such a URL is a 400")
    max_image_bytes: int = _knob(20 * 1024 * 1024, "most bytes one encoded image may have. [1 KiB, 1 GiB]")
    max_image_pixels: int = _knob(
        40_000_000, "most pixels (width x height) one decoded image may have, checked from its header before "
        "decoding (a decompression bomb is refused). [1, 89478485]: Pillow's own bomb limit caps it")
    max_images_per_request: int = _knob(16, "most images in one request. [0, 1024]")
    mm_encoder_cache_mb: float = _knob(
        256.0, "MB of vision-tower outputs kept by image hash, so an image seen again (a chunk that cuts it, a "
        "second request) is not encoded twice. [0, 65536]")
    # --- scheduling ---
    max_running_requests: int = _knob(64, "most requests decoding at once")
    max_prefill_tokens: int = _knob(8192, "most prompt tokens admitted into one prefill step")
    chunked_prefill_size: int = _knob(2048, "a longer prompt runs as several EXTEND chunks; <=0 disables")
    schedule_policy: str = _knob("fcfs", "fcfs | lpm (longest prefix match first)")
    disable_radix_cache: bool = _knob(False, "no prefix sharing: KV freed when a request finishes")
    enable_hierarchical_cache: bool = _knob(
        False, "a disk tier under the radix cache (mem_cache/hiradix_cache.py): evicted and twice-reused prefixes, "
        "and every cached prefix at shutdown, are written to --hicache-storage-dir and read back on a match, also "
        "after a restart. Needs --hicache-storage-dir"
    )
    hicache_storage_dir: str | None = _knob(
        None, "directory of the disk tier (created if missing; an unwritable one is a start-up error). Entries are "
        "keyed by the model files, dtypes, KV dtype, TP/PP rank and LoRA adapter: another model never hits them"
    )
    hicache_size: float = _knob(
        16.0, "GiB the disk tier may fill (this model's folder in --hicache-storage-dir); the least recently used "
        "blocks are deleted past it. (0, 100000]"
    )
    enable_mixed_chunk: bool = _knob(False, "run a prefill chunk and the running decodes in one MIXED forward")
    init_new_token_ratio: float = _knob(0.7, "initial share of max_new_tokens reserved for running requests")
    min_new_token_ratio: float = _knob(0.1, "floor the reservation decays to")
    new_token_ratio_decay: float = _knob(0.001, "reservation decay per decode step")
    stream_interval: int = _knob(1, "send streamed output every N tokens")
    # --- parallelism ---
    tp_size: int = _knob(1, "tensor-parallel ranks (processes) per pipeline stage")
    ep_size: int = _knob(
        1, "expert-parallel groups among the tp_size ranks (a mixture-of-experts model): each group holds "
        "num_experts / ep_size whole experts, attention stays tensor-parallel over all tp_size; must divide tp_size"
    )
    pp_size: int = _knob(
        1, "pipeline-parallel stages: the layers split into this many contiguous stages (embedding on the first, "
        "final norm + LM head on the last), each stage tp_size ranks; tp_size * pp_size <= 64"
    )
    dp_size: int = _knob(
        1, "data-parallel replicas: each a full scheduler group (tp_size * pp_size processes) with its own weights "
        "and KV pool (--max-total-tokens, --max-running-requests are per replica); requests are routed by "
        "--load-balance-method"
    )
    # prefix_aware: measured best by `radixserve bench dp` (README, "Data parallel")
    load_balance_method: str = _knob(
        "prefix_aware", "round_robin | shortest_queue | prefix_aware: how --dp-size > 1 routes each request. "
        "shortest_queue = the replica with the fewest requests in flight; prefix_aware = the replica whose recent "
        "prompts share the longest prefix with this one (its radix cache likely holds it), else shortest_queue"
    )
    nnodes: int = _knob(1, "machines the tp_size * pp_size ranks are spread over (evenly, in rank order)")
    node_rank: int = _knob(0, "this machine's rank among nnodes (0 serves HTTP; the others only run ranks)")
    dist_init_addr: str | None = _knob(
        None, "host:port where node 0 hosts the rendezvous (a torch.distributed TCPStore) every rank and node "
        "joins; default 127.0.0.1 and a free port (required when nnodes > 1)"
    )
    dist_timeout: float = _knob(
        600.0, "seconds one collective / send / recv may wait for a peer before the rank fails (a hung peer); "
        "larger than the longest step (a long prefill on CPU), 5..86400"
    )
    dist_init_timeout: float = _knob(
        120.0, "seconds a node waits to reach --dist-init-addr, and node 0 for the other nodes to join, "
        "before failing with a message naming the address, 1..3600"
    )
    # --- speculative decoding ---
    speculative_algorithm: str | None = _knob(
        None, "None | ngram | draft_model: speculative decoding. ngram drafts from each request's own tokens "
        "(prompt lookup), draft_model from --speculative-draft-model-path; the target verifies each request's "
        "drafts in one TARGET_VERIFY forward with the rejection rule, so outputs follow its distribution "
        "exactly (greedy and seeded: token for token what plain decoding gives)"
    )
    speculative_draft_model_path: str | None = _knob(
        None, "draft_model: a smaller model with the target's tokenizer (GGUF file or Hugging Face folder); it "
        "gets its own KV pool (as many tokens as the target's, plus drafts)"
    )
    # 3 drafts: ~3 tokens accepted per verify on copy-heavy text (bench speculative), little waste elsewhere
    speculative_num_draft_tokens: int = _knob(3, "most draft tokens verified per request per step (1..16)")
    # 2: a one-token match is mostly chance, and a rejected verify costs about a decode step (measured: bench speculative)
    speculative_ngram_min_match_window: int = _knob(2, "ngram: shortest suffix that may match (tokens)")
    speculative_ngram_max_match_window: int = _knob(8, "ngram: longest suffix tried first (tokens, <= 64)")
    # --- structured output and tool calling ---
    grammar_backend: str = _knob(
        "xgrammar", "xgrammar | none: constrained decoding (json_schema / regex / ebnf / structural_tag, OpenAI "
        "response_format and forced tool calls); none refuses such requests with a 400"
    )
    grammar_cache_size: int = _knob(256, "compiled grammars kept (LRU over distinct constraints), 1..100000")
    grammar_compile_timeout: float = _knob(
        30.0, "seconds a request may wait for its grammar to compile before it fails with a 400 (0 < t <= 3600)"
    )
    tool_call_parser: str = _knob(
        "auto", f"{' | '.join(TOOL_CALL_PARSERS)}: the model's tool-call format, parsed out of its output "
        "(auto = read from the chat template; hermes for templates without tool support; docs/tool_calls.md)"
    )
    # --- reasoning (parser/; docs/reasoning.md) ---
    reasoning_parser: str | None = _knob(None, f"{' | '.join(REASONING_PARSER_NAMES)}: split <think> reasoning "
                                         "out of chat answers, grammars start after it (auto: from the template)")
    thinking_budget: int | None = _knob(None, "default thinking budget in tokens: past it </think> is forced")
    # --- embeddings (managers/embedding_mode.py, docs/embeddings.md) ---
    is_embedding: bool = _knob(
        False, "serve the model as an embedding model: /v1/embeddings and Engine.encode give the pooled, "
        "L2-normalised final hidden state; the generation routes answer 400"
    )
    pooling: str = _knob(
        "last", "last | mean: how --is-embedding pools the final hidden states (last = the last token's, as "
        "Qwen3-Embedding and e5-mistral; mean = the average over the prompt, as gte)"
    )
    # --- LoRA adapters (radixserve/lora/) ---
    lora_paths: tuple[str, ...] | None = _knob(
        None, "LoRA adapters served beside the base model: name=path (a PEFT folder or a llama.cpp .gguf "
        "adapter) ...; requests pick one with "
        "lora_path (native) or model='adapter' / 'base:adapter' (OpenAI)", nargs="+"
    )
    enable_lora: bool = _knob(False, "serve LoRA adapters (implied by --lora-paths): hooks on every projection")
    max_lora_rank: int = _knob(64, "largest adapter rank accepted (1..1024)")
    max_loaded_loras: int = _knob(8, "adapters held in memory, least recently used evicted (1..1024)")
    max_loras_per_batch: int = _knob(8, "distinct adapters in one step; requests for more wait (1..max_loaded_loras)")
    lora_dir: str | None = _knob(None, "if set, /load_lora_adapter only reads adapters inside this folder")
    # --- misc ---
    random_seed: int = _knob(0, "seed for sampling requests that bring no seed")
    num_threads: int | None = _knob(
        None, "torch intra-op threads of each scheduler process (default: the machine's cores split over its "
        "scheduler processes, tp_size x pp_size / nnodes x dp_size)"
    )
    trace_batches: str | None = _knob(None, "write one JSON line per step to this file")
    check_invariants: bool = _knob(False, "validate every ForwardBatch and the KV accounting each step")
    log_level: str = _knob("warning", "logging level")
    show_progress: bool = _knob(True, "tqdm bar for large offline batches")

    def __post_init__(self) -> None:
        check_server_args(self)  # server_args_checks.py: every rule on the knobs, in one place

    @property
    def ranks_per_replica(self) -> int:
        """Processes one model replica runs on (tp_size * pp_size). The native decode stack (CpuGraphRunner)
        is single-rank: with more, DECODE steps run layer by layer (low-bit weights shard like float ones)."""
        return self.tp_size * self.pp_size

    # NOTE: chunking is expressed in whole pages so that a chunk boundary is a page boundary.
    @property
    def effective_chunk_size(self) -> int | None:
        if self.chunked_prefill_size is None or self.chunked_prefill_size <= 0:
            return None
        return max(self.page_size, self.chunked_prefill_size // self.page_size * self.page_size)

    def resolved_model_path(self) -> str:
        if self.model_path is not None:
            return self.model_path
        return default_model_path()

    def model_name(self) -> str:
        """The name the API reports (the first served name)."""
        return self.model_names()[0]

    def model_names(self) -> list[str]:
        """Every name the API answers to: the served names (or the file name), then 'default'."""
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        if not names:
            names = [os.path.basename(os.path.normpath(self.resolved_model_path()))]
        return names + ([] if "default" in names else ["default"])

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown ServerArgs field(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # ---------------- CLI ----------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            base = _base_type(f.type)
            if base is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            else:
                parser.add_argument(flag, type=base, default=f.default, help=f"{help_text} (default: {f.default})",
                                    **({"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}))
        # SGLang spells it --model too.
        parser.add_argument("--model", dest="model_path", default=argparse.SUPPRESS, help="alias of --model-path")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _base_type(annotation: Any) -> type:
    # Annotations are strings under `from __future__ import annotations`.
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split("|")[0].strip() == name:
            return typ
    if get_origin(annotation) is not None:
        return next(a for a in get_args(annotation) if a is not type(None))
    return str
