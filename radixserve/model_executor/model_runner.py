"""ModelRunner: the execution shell.

It owns the model, the parallel state (tp and pp rank/size), the memory pools' tensors, the attention
backend and the sampler, and turns one ForwardBatch into logits and next tokens. With pp_size > 1 it
holds one pipeline stage: its layers, their KV, and a PipelineStage that moves activations between
stages and shares the last stage's sampled tokens with every rank (pipeline_stage.py). It never
picks requests and never sees a Req: the scheduler has decided *who* runs; this decides *how*.

Init order (each step needs the one before): parallel state -> model config -> weights (this rank's
shard) -> KV pool sized from what is left -> attention backend -> sampler

Execution mode: exact (the default: each op on its fastest path) or deterministic
(--enable-deterministic-inference: batch-invariant, see layers/batch_invariant.py). The mode is
decided once, in _make_attn_backend (which fails start-up if the mode cannot be honoured here); with
the low-bit choice (which steps run the low-bit weight copies) it makes the runner's KernelMode
(layers/kernel_mode.py), which every ForwardBatch this runner builds carries to the layers, and the
Sampler is built with it. Nothing is set on the model for a step: runners may share its weights.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from radixserve.distributed.parallel_state import ParallelState, init_parallel_state
from radixserve.distributed.rank_layout import RankLayout, check_model_fits
from radixserve.kernels.cpu import load_cpu_ops, native_bf16_matmul
from radixserve.layers.attention.base_attn_backend import AttentionBackend
from radixserve.layers.attention.batch_invariant_backend import BatchInvariantAttnBackend
from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.batch_invariant import ROW_TILE
from radixserve.layers.cpu_kernel_layer import enable_cpu_kernels, kernel_ops
from radixserve.layers.kernel_mode import KernelMode
from radixserve.layers.linear import (
    PackableLinear,
    has_float_weights,
    model_weight_bytes,
    onednn_linear_available,
    prepare_float_weights,
    release_float_weights,
    resolve_linear_backend,
    resolve_low_bit_max_rows,
)
from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.plan import QuantReport, quantize_model
from radixserve.layers.rejection_sampler import RejectionSampler
from radixserve.layers.sampler import Sampler
from radixserve.lora.lora_batch import LoRABatch
from radixserve.lora.runner_setup import lora_batch_for, make_lora_manager
from radixserve.mem_cache.kv_quant import KV_FP8, KV_INT8, kv_row_width
from radixserve.mem_cache.memory_pool import KVPool
from radixserve.mem_cache.swa_memory_pool import SWAKVPool, plan_swa
from radixserve.model_executor.cpu_graph_runner import CpuGraphRunner
from radixserve.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch, PPProxyTensors
from radixserve.model_executor.memory_budget import plan_runner_memory
from radixserve.model_executor.memory_pools import init_memory_pools
from radixserve.model_executor.pipeline_stage import PipelineStage
from radixserve.model_executor.results import GenerationBatchResult, SampleOutput
from radixserve.model_executor.sample_logprobs import add_logprobs
from radixserve.model_loader import get_model_config, get_tokenizer, iterate_weights, model_kind
from radixserve.model_loader.gguf_loader import load_for_runner
from radixserve.model_loader.mmproj import iterate_mmproj_weights, with_mmproj
from radixserve.models.registry import get_model_class
from radixserve.models.vision.vision_language import attach_vision
from radixserve.server_args import ServerArgs
from radixserve.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_DTYPES = {**DTYPES, "int8": KV_INT8, "fp8_e4m3": KV_FP8}  # quantised rows: mem_cache/kv_quant.py


def resolve_dtype(name: str, device: torch.device, deterministic: bool = False) -> torch.dtype:
    """--dtype -> a torch dtype. `auto`: on a CPU, bfloat16 where it has native bf16 matmul (AMX-BF16 or
    AVX512-BF16, read at run time from what this CPU reports; oneDNN must agree), float32 elsewhere and
    under --enable-deterministic-inference; on CUDA, bfloat16 where supported, else float16."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not deterministic and native_bf16_matmul() and onednn_linear_available(torch.bfloat16):
        return torch.bfloat16
    return torch.float32


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        rank: int = 0,
        parallel_state: ParallelState | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`rank`: in the replica (rank_layout.py numbers them). `model`: reuse already-loaded weights (same
        model path and layout) — lets tests and benchmarks compare pool/page configurations without reloading."""
        self.server_args = server_args
        layout = RankLayout(server_args.tp_size, server_args.pp_size, server_args.nnodes)
        cuda = f"cuda:{layout.local_rank(rank)}"
        self.device = torch.device(server_args.device if server_args.device != "cuda" else cuda)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL joins: its communicators bind the current device
        self.deterministic = server_args.enable_deterministic_inference
        # dtype: the GEMMs' dtype (--dtype, `auto` resolved for this device); act_dtype: everything
        # else's. On a CPU activations, norms, attention math and sampling stay float32 (the C++
        # kernels' precision) and a bf16 dtype means bf16 weights and GEMMs (AMX); on CUDA both are dtype.
        self.dtype = resolve_dtype(server_args.dtype, self.device, self.deterministic)
        self.act_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        # the KV pool's storage dtype; attention widens it to the activation dtype as it reads
        self.kv_cache_dtype = self.dtype if server_args.kv_cache_dtype == "auto" else KV_DTYPES[server_args.kv_cache_dtype]
        self.tp_rank, self.tp_size = layout.tp_rank(rank), server_args.tp_size
        self.pp_rank, self.pp_size = layout.pp_rank(rank), server_args.pp_size
        # scheduler processes on this machine: they share its cores and its memory
        self.local_procs = local_procs = layout.ranks_per_node * server_args.dp_size
        if self.device.type == "cpu" and server_args.num_threads:
            torch.set_num_threads(server_args.num_threads)
        elif self.device.type == "cpu" and local_procs > 1:
            # the machine's cores split across its ranks, of every replica: a rank never oversubscribes them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_procs))
        self.model_path = server_args.resolved_model_path()
        self.model_config = get_model_config(self.model_path, server_args.context_length)
        if server_args.mmproj:  # llama.cpp's pair of files: the vision tower and projector in their own GGUF
            self.model_config = with_mmproj(self.model_config, server_args.mmproj,
                                            get_tokenizer(self.model_path, server_args.tokenizer_path))
        # the launcher checked before starting us
        check_model_fits(self.model_config, self.tp_size, self.pp_size, server_args.ep_size)
        if self.kv_cache_dtype in (KV_INT8, KV_FP8):  # quantised rows: the CPU kernels read them, for these shapes
            try:
                if self.device.type != "cpu":
                    raise ValueError(f"the {self.device.type} attention path cannot read them")
                kv_row_width(self.kv_cache_dtype, self.model_config.head_dim)
            except ValueError as e:
                raise ValueError(f"ServerArgs.kv_cache_dtype: {server_args.kv_cache_dtype} is read by the CPU attention "
                                 f"kernels only ({e}; device {self.device.type}, head_dim "
                                 f"{self.model_config.head_dim}); use bfloat16") from None
        self.parallel_state = parallel_state or init_parallel_state(
            rank, layout, server_args.dist_init_addr, server_args.device, server_args.dist_timeout,
            server_args.dist_init_timeout, server_args.ep_size,
        )
        self.stage_layers = self.parallel_state.stage_layers(self.model_config.num_hidden_layers)
        # a hybrid pool for sliding-window layers (mem_cache/swa_memory_pool.py), or one pool
        self.swa_plan, why = plan_swa(server_args, {i: self.model_config.layer_window(i) for i in self.stage_layers},
                                      self.model_config.context_len)
        logger.info("sliding-window KV pool: %s", why if self.swa_plan else f"off ({why})")
        self.spec_algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
        self.quantization = self._resolve_quantization()
        # steps of at most this many rows run the low-bit copy (None = every step; layers/linear.py)
        self.quant_max_rows = resolve_low_bit_max_rows(server_args.quant_max_rows)
        self._load_model(model)
        # Gemma 3's image spans attend both ways: ForwardBatch.attn_q_last
        self.image_spans_bidirectional = bool(getattr(self.model, "image_spans_bidirectional", False))
        self._init_memory_pool()
        self.attn_backend = self._make_attn_backend()
        self.quant_ops = self._quant_ops()
        # what this runner's steps compute with, fixed now; every ForwardBatch it builds carries it
        self.kernel_mode = KernelMode(self.quant_ops, self.quant_max_rows, self.deterministic)
        self.cpu_graph_runner = CpuGraphRunner.maybe_create(self)
        self.lora_manager = make_lora_manager(self)  # None unless --enable-lora / --lora-paths
        self.sampler = Sampler(batch_invariant=self.deterministic, cpu_ops=kernel_ops(self.model))
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.timers = {"forward_batch_init_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
        self.pipeline = None
        if self.pp_size > 1:
            self.pipeline = PipelineStage(self)

    # ------------------------------------------------------------------ init
    def _resolve_quantization(self) -> str:
        """--quantization auto -> what this runner will do: the GGUF's own low-bit blocks on a CPU in
        float32 with the C++ kernels, `none` everywhere else (HF folders, GPUs, deterministic mode). Any tp / pp:
        each rank quantises the shard of the layers it holds."""
        mode = self.server_args.quantization
        if mode != "auto":
            return mode
        if self.device.type != "cpu" or self.deterministic:
            return "none"
        if model_kind(self.model_path) != "gguf":
            return "none"
        ops, reason = load_cpu_ops()
        if ops is None:
            logger.warning("quantization auto: no C++ CPU kernels here (%s); running float weights only",
                           reason.splitlines()[0][:200] if reason else "unknown")
            return "none"
        return "auto"

    def _load_model(self, model: torch.nn.Module | None) -> None:
        t0 = time.perf_counter()
        self.linear_backend = resolve_linear_backend(self.server_args.linear_backend, self.device, self.dtype)
        self.quant_report = QuantReport()
        if model is not None:
            # NOTE: a shared model is never changed per runner (each runner's kernel choices travel in its
            # ForwardBatches), so runners of different modes may share it; what must hold is that this
            # runner can compute with the weights the model kept
            self.model = model
            has_q = any(isinstance(m, PackableLinear) and m.qweight is not None for m in model.modules())
            if self.quantization in ("int8", "int4") and not has_q:
                raise ValueError(f"quantization {self.quantization}: a shared model must have been loaded with it")
            if not has_q:
                self.quantization = "none"
            if not has_float_weights(model) and (self.quantization == "none" or self.quant_max_rows is not None):
                raise ValueError("a shared model that kept only its low-bit weights needs a runner that runs every "
                                 "step low-bit (same quantization, quant_max_rows unset)")
            if has_float_weights(model):  # idempotent: a shared model is prepared once
                prepare_float_weights(model, self.linear_backend, self.dtype, self.low_bit_only())
            self.weight_bytes = model_weight_bytes(model)
            self.memory_budget, self._min_kv_bytes = plan_runner_memory(self, self.weight_bytes)
            return
        cls = get_model_class(self.model_config.architecture)
        # empty parameters: nothing is resident until a loader writes it (the GGUF low-bit path never does)
        self.model = cls(self.model_config, self.parallel_state).to(dtype=self.act_dtype)
        if self.model_config.mm_config is not None:
            attach_vision(self.model, self.server_args)  # its encoder cache, and where its vision tensors are
        # a pipeline stage reads only its tensors
        keep = self.model.holds_checkpoint_tensor if self.pp_size > 1 else None
        # the memory budget, checked before any weight is read (model_executor/memory_budget.py)
        self.memory_budget, self._min_kv_bytes = plan_runner_memory(self)
        if self.quantization != "none" and model_kind(self.model_path) == "gguf":
            # from the mapped file; long steps' float copies only where they fit (it may turn quant_max_rows off)
            self.quant_report, self.quant_max_rows = load_for_runner(self, keep)
            self.model.to(self.device).eval()
            self.quantization = self.quantization if self.quant_report.counts else "none"  # F16 / F32: nothing packed
        else:
            self.model.load_weights(iterate_weights(self.model_path, keep))
            self.model.to(self.device).eval()
            if self.quantization != "none":
                self._quantize_model()  # from the dense weights, before packing frees them
            if self.low_bit_only():
                # every step runs low-bit: the float copies of the quantised projections are never read
                release_float_weights(self.model)
        if self.server_args.mmproj and self.model.has_vision:
            self.model.load_vision_weights(iterate_mmproj_weights(self.server_args.mmproj))
        prepare_float_weights(self.model, self.linear_backend, self.dtype, self.low_bit_only())
        self.weight_bytes = model_weight_bytes(self.model)
        self.memory_budget.weights = self.weight_bytes - self.memory_budget.float_copy  # measured now
        logger.info("loaded %s (%.0f MB) in %.1fs", self.model_path, self.weight_bytes / 2**20, time.perf_counter() - t0)

    def _kv_bytes_per_token(self) -> int:
        # this stage's layers and this rank's KV heads only: a pipeline stage's pool fits more tokens
        kv_heads = max(1, self.model_config.num_key_value_heads // self.tp_size)
        plan, head_dim = self.swa_plan, self.model_config.head_dim
        if plan is not None:  # a slot of the full pool, and `ratio` slots of the sliding-window pool
            n_swa = len(plan.layer_ids)
            return math.ceil(SWAKVPool.bytes_per_full_token(len(self.stage_layers) - n_swa, n_swa, plan.ratio,
                                                            kv_heads, head_dim, self.kv_cache_dtype))
        return KVPool.bytes_per_token(len(self.stage_layers), kv_heads, head_dim, self.kv_cache_dtype)

    def low_bit_row_limit(self) -> int | None:
        """Most rows a step may have and still run on the low-bit kernels; None = any number, or no low-bit
        weights at all (nothing to stay within). What the speculative verify sizes its rows by."""
        return self.quant_max_rows if self.quant_ops is not None else None

    def low_bit_only(self) -> bool:
        return self.quantization != "none" and self.quant_max_rows is None

    def _quantize_model(self) -> None:
        sources = getattr(self.model, "checkpoint_sources", None)
        if sources is None:
            logger.warning("quantization: %s does not name its checkpoint sources; float weights only",
                           type(self.model).__name__)
            self.quantization = "none"
            return
        # the loaded float weights (a HF folder: int8 / int4 re-quantise them in place)
        def dense(_: str, m: torch.nn.Module) -> Any:
            return (m.w13, m.w2) if isinstance(m, FusedMoE) else m.weight

        self.quant_report = quantize_model(self.model, self.quantization, sources, dense)
        if not self.quant_report.counts:
            self.quantization = "none"  # e.g. an F16 / F32 GGUF: nothing to pack
        logger.info("quantization %s: %s (%.0f MB low-bit copy)", self.server_args.quantization,
                    self.quant_report.summary(), self.quant_report.bytes / 2**20)

    def _quant_ops(self) -> Any:
        if self.quantization == "none":
            return None
        ops, reason = load_cpu_ops()
        if ops is None or not hasattr(ops, "quant_linear"):
            raise RuntimeError(f"quantization {self.quantization} needs radixserve's C++ CPU kernels: "
                               f"{reason or 'quant_linear missing'}")
        return ops

    def _make_attn_backend(self) -> AttentionBackend:
        choice = self.server_args.attention_backend
        cpu_fp32 = self.device.type == "cpu" and self.act_dtype == torch.float32
        if self.deterministic:
            return self._make_deterministic_backend(cpu_fp32)
        if choice == "torch_native" or (choice == "auto" and not cpu_fp32):
            enable_cpu_kernels(self.model, None)
            return TorchNativeAttnBackend(self.device)
        if not cpu_fp32:
            raise ValueError("ServerArgs.attention_backend: cpu_paged needs device=cpu and dtype=float32")
        ops, reason = load_cpu_ops()
        if ops is None:
            if choice == "cpu_paged":
                raise ValueError(f"ServerArgs.attention_backend: cpu_paged could not be built here ({reason})")
            return TorchNativeAttnBackend(self.device)
        # the same library carries the layers' glue (fused add + RMSNorm, RoPE, SiLU-and-mul)
        enable_cpu_kernels(self.model, ops)
        return CpuPagedAttnBackend(self.device, ops.paged_attention, ops.extend_attention)

    def _make_deterministic_backend(self, cpu_fp32: bool) -> AttentionBackend:
        """--enable-deterministic-inference: the C++ kernels or nothing. Falling back to the PyTorch
        paths would silently give batch-dependent results, so a machine that cannot build them fails here."""
        flag = "--enable-deterministic-inference"
        if self.image_spans_bidirectional:
            raise ValueError(f"enable_deterministic_inference: {self.model_config.architecture}'s image tokens attend "
                             "to their whole image, and the batch-invariant attention kernel is causal only")
        if not cpu_fp32:
            raise ValueError(f"{flag} needs device=cpu and dtype=float32")
        ops, reason = load_cpu_ops()
        if ops is None:
            raise RuntimeError(
                f"{flag} needs radixserve's C++ CPU kernels (batch-invariant attention), which could not be "
                f"built on this machine: {reason.splitlines()[0][:300] if reason else 'unknown error'}. Install a "
                "C++ compiler and ninja, or start without the flag."
            )
        if not hasattr(ops, "paged_attention_varlen"):
            raise RuntimeError(
                f"{flag}: the C++ kernel library that was loaded predates paged_attention_varlen (a stale build "
                "in the kernel cache); touch radixserve/kernels/cpu/csrc/ops.cpp or clear "
                "~/.cache/radixserve/kernels to rebuild it"
            )
        enable_cpu_kernels(self.model, ops)  # RMSNorm / RoPE / SiLU: per-row C++ loops
        logger.info(
            "deterministic inference ON: GEMMs in %d-row tiles (%s), paged_attention_varlen for every "
            "forward mode, per-row sampling", ROW_TILE, self.linear_backend,
        )
        return BatchInvariantAttnBackend(self.device, ops.paged_attention_varlen)

    def _init_memory_pool(self) -> None:
        (self.max_total_num_tokens, self.swa_max_total_num_tokens, self.swa_plan, self.req_to_token_pool,
         self.token_to_kv_pool_allocator, self.token_to_kv_pool) = init_memory_pools(self)

    # ------------------------------------------------------------------ run
    def forward(
        self, forward_batch: ForwardBatch, pp_proxy: PPProxyTensors | None = None
    ) -> LogitsProcessorOutput | PPProxyTensors:
        """One forward pass; the mode decides the attention path inside the backend. A pipeline stage after
        the first starts from `pp_proxy`; one before the last returns its PPProxyTensors."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return LogitsProcessorOutput(next_token_logits=torch.empty(0, self.model_config.vocab_size))
        # adapter rows: the stack adds their deltas when the step is few rows (LoRABatch.dense)
        if self.cpu_graph_runner is not None and self.cpu_graph_runner.can_run(forward_batch):
            return self.cpu_graph_runner.replay(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch, pp_proxy)

    def lora_batch_for(self, uids: list[int] | None, rows_per_req: list[int]) -> LoRABatch | None:
        """A step's adapter groups (ForwardBatch.lora_batch); None unless some row uses an adapter."""
        return lora_batch_for(self, uids, rows_per_req)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SampleOutput:
        logits = logits_output.next_token_logits
        # the sampler edits the logits in place (penalties, temperature); logprobs are of the raw distribution
        raw = logits.clone() if forward_batch.return_logprob or forward_batch.token_ids_logprobs else None
        info = forward_batch.sampling_info
        if forward_batch.forward_mode.is_target_verify():
            spec = forward_batch.spec_info
            ids, accept = self.rejection_sampler(logits, info, forward_batch.input_ids.tolist(), spec.draft_lens,
                                                 spec.draft_probs)
            # tensor parallel: every rank has the same logits but its own random draws; rank 0's decide
            accept = self.parallel_state.broadcast_tensor(torch.tensor(accept, dtype=torch.int64)).tolist()
            out = SampleOutput(next_token_ids=self.parallel_state.broadcast_tensor(ids), accept_lens=accept)
        elif forward_batch.return_probs:
            ids, probs = self.sampler.sample_with_probs(logits, info)
            out = SampleOutput(next_token_ids=self.parallel_state.broadcast_tensor(ids), probs=probs)
        else:
            # tensor parallel: every rank has the same (gathered) logits, but random draws could differ;
            # rank 0's tokens are the ones every rank's scheduler appends
            out = SampleOutput(next_token_ids=self.parallel_state.broadcast_tensor(self.sampler(logits, info)))
        if raw is not None:
            add_logprobs(out, torch.log_softmax(raw.float(), dim=-1), forward_batch, self.deterministic)
        return out

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """ModelWorkerBatch -> ForwardBatch -> forward -> sample: the whole execution step.

        Cumulative wall time of each part is kept in `self.timers` (the scheduler reports it): on CPU
        every op is synchronous, so these are true costs; on CUDA forward/sample would only time
        the launches unless the caller synchronises."""
        t0 = time.perf_counter()
        forward_batch = ForwardBatch.init_new(batch, self)
        if self.pipeline is not None:
            return self.pipeline.forward_and_sample(forward_batch, t0)
        t1 = time.perf_counter()
        logits_output = self.forward(forward_batch)
        t2 = time.perf_counter()
        sample_output = self.sample(logits_output, forward_batch)
        t3 = time.perf_counter()
        tm = self.timers
        tm["forward_batch_init_s"] += t1 - t0
        tm["forward_s"] += t2 - t1
        tm["sample_s"] += t3 - t2
        return GenerationBatchResult(logits_output, sample_output, forward_batch)
