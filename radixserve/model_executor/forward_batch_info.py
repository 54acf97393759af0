"""ModelWorkerBatch and ForwardBatch (and ForwardMode, from forward_mode.py): the execution side of the batch
pipeline.

    ScheduleBatch (CPU, scheduler)        who runs this step and why: Reqs, queues, prefix matches
        | get_model_worker_batch()
        v
    ModelWorkerBatch (CPU, plain data)    a snapshot: no live Req objects, so the scheduler may
        |                                 mutate its own state while this step computes
        | ForwardBatch.init_new(mwb, model_runner)
        v
    ForwardBatch (device tensors)         what to compute: input_ids, positions, seq_lens,
        |                                 out_cache_loc, sampling info; nothing about queues
        v
    ModelRunner.forward()                 how: this model, this attention backend, this TP rank

Index arithmetic for one EXTEND request (prefix cached, new part computed this step):

    position:   0 ........ prefix_len-1 | prefix_len ........ seq_len-1
    KV:         read from req_to_token   | written at out_cache_loc (extend_len slots)
    query:      -                        | extend_len rows of input_ids / positions

DECODE is the case extend_len == 1, prefix_len == seq_len - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.layers.kernel_mode import EXACT, KernelMode
from radixserve.model_executor.forward_mode import CaptureHiddenMode, ForwardMode
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from radixserve.lora.lora_batch import LoRABatch
    from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.multimodal.mm_inputs import MultimodalInputs
    from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class PPProxyTensors:
    """What one pipeline stage hands the next in place of the layers it ran: the hidden states and the
    residual stream after its last layer (the next stage's first input_layernorm adds them)."""

    hidden_states: torch.Tensor  # [n_tokens, hidden]
    residual: torch.Tensor  # [n_tokens, hidden]


@dataclass
class ModelWorkerBatch:
    """Plain snapshot handed from the scheduler to the execution layer (CPU lists, one tensor)."""

    forward_mode: ForwardMode
    input_ids: list[int]  # [n_tokens] all requests' new tokens, concatenated
    req_pool_indices: list[int]  # [bs]
    seq_lens: list[int]  # [bs] length after this step
    prefix_lens: list[int]  # [bs] tokens already in the KV cache
    out_cache_loc: torch.Tensor  # [n_tokens] int64 slots, allocated by the scheduler
    # Per sampled row: one per request, or (TARGET_VERIFY) one per verified position (ScheduleBatch
    # .get_model_worker_batch says what each row's history holds).
    sampling_params: list[SamplingParams]
    # Token history per row; only needed for penalties / min_new_tokens / seeds (None = not needed).
    output_ids: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None  # per row, only when a request uses repetition_penalty
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)  # per row
    # Per request, None or the token that follows each of its positions in this step (the
    # prompt tokens whose logprobs are wanted); the scheduler knows the prompt, the runner does not.
    prompt_logprob_targets: list[list[int] | None] = field(default_factory=list)
    # Per sampled row, None or the token ids whose logprobs it returns (a request's token_ids_logprob);
    # empty when no request asks
    token_ids_logprobs: list[list[int] | None] = field(default_factory=list)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    spec_info: Any = None  # TARGET_VERIFY: the drafts' layout (speculative/spec_info.py VerifyInput)
    # MIXED: the first this many requests are prefill chunks, the rest decodes (a 1-token chunk after a
    # prefix is still prefill: its attention must run the kernel its prompt's other tokens ran). None =
    # by shape: a request with one new token after a prefix is a decode
    num_extend_reqs: int | None = None
    # also return the distribution each row was drawn from (SampleOutput.probs: a draft model's q)
    return_probs: bool = False
    # Constrained decoding: xgrammar's bitmask int32 [rows, ceil(vocab / 32)] of the allowed next tokens,
    # one row per sampled position (a request; TARGET_VERIFY: each verified position), filled by the
    # scheduler from each request's grammar; None when no request is constrained.
    vocab_mask: torch.Tensor | None = None
    # LoRA: per request, the adapter registration its rows use (0 = the base model); None when no request
    # has one (lora/lora_manager.py: a uid, so an unload + reload of a name never mixes two adapters)
    lora_uids: list[int] | None = None
    # images: per request, its MultimodalInputs when this step computes some of its image tokens, else None;
    # None when no request's step does (multimodal/mm_embedding.py)
    mm_inputs: list[MultimodalInputs | None] | None = None
    # M-RoPE: per request its MultimodalInputs (its rotary positions) in every step, decode included; None when no
    # request of the batch has M-RoPE positions
    mrope_inputs: list[MultimodalInputs | None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prefix_lens)]


@dataclass
class ForwardBatch:
    """Everything one forward pass consumes, as device tensors, built complete by init_new."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [n_tokens] int64
    positions: torch.Tensor  # [n_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    seq_lens_cpu: list[int]
    extend_seq_lens: torch.Tensor  # [bs] new tokens per request (1 for decode)
    extend_prefix_lens: torch.Tensor  # [bs] cached tokens per request
    extend_start_loc: torch.Tensor  # [bs] offset of each request's first new token in input_ids
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [n_tokens] int64
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    sampling_info: SamplingBatchInfo | None
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[list[int] | None] = field(default_factory=list)
    token_ids_logprobs: list[list[int] | None] = field(default_factory=list)  # see ModelWorkerBatch
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    spec_info: Any = None
    num_extend_reqs: int | None = None  # MIXED: see ModelWorkerBatch
    return_probs: bool = False
    lora_uids: list[int] | None = None  # LoRA: see ModelWorkerBatch
    # which adapter each token row uses and the delta the targeted projections add (None: base-only step)
    lora_batch: LoRABatch | None = None
    mm_inputs: list[MultimodalInputs | None] | None = None  # see ModelWorkerBatch
    # [n_tokens] int64, the last key position each row attends to, where some row sees past itself: a model whose
    # image spans attend both ways (Gemma 3) has each image row see its whole span. None: causal (every other step)
    attn_q_last: torch.Tensor | None = None
    # [3, n_tokens] M-RoPE rotary positions (t, h, w) of a step with a Qwen2.5-VL request (image tokens: their grid's
    # rows and columns; later tokens: position + the request's delta). None: positions are the rotary positions
    mrope_positions: torch.Tensor | None = None
    # the runner's kernel choices (low-bit copies and their row cap, batch-invariant), fixed at load
    kernel_mode: KernelMode = EXACT
    attn_backend: Any = None
    # The one documented late addition: the attention backend's per-step metadata, derived
    # once in init_forward_metadata() and shared by every layer.
    attn_metadata: Any = None
    # The step's cos / sin rows, per (RotaryEmbedding, positions tensor): each RoPE base gathers its rows once
    # a step, not once a layer. It lives and dies with this step, so a positions buffer refilled in place by a
    # later step can never meet stale rows.
    rope_rows: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: ModelRunner) -> ForwardBatch:
        device = model_runner.device
        bs = batch.batch_size
        seq_lens_cpu = list(batch.seq_lens)
        prefix_cpu = list(batch.prefix_lens)
        extend_cpu = [s - p for s, p in zip(seq_lens_cpu, prefix_cpu)]
        n_tokens = len(batch.input_ids)
        if sum(extend_cpu) != n_tokens or batch.out_cache_loc.numel() != n_tokens:
            raise ValueError(
                f"inconsistent batch: {n_tokens} input ids, {sum(extend_cpu)} extend tokens, "
                f"{batch.out_cache_loc.numel()} out_cache_loc slots"
            )
        if batch.forward_mode.is_decode():
            # one tensor for the step's three int lists (views of it), the rest derived: a batch-1 decode step's
            # Python is ~15% of it on a 2-vCPU Zen 3, and each small tensor costs a few us
            ints = torch.tensor(seq_lens_cpu + batch.input_ids + batch.req_pool_indices, dtype=torch.int64)
            seq_lens, input_ids, req_pool_indices = ints[:bs], ints[bs : 2 * bs], ints[2 * bs :]
            positions = seq_lens - 1
            prefix = seq_lens - 1
            extend_lens = torch.ones(bs, dtype=torch.int64)
            start_loc = torch.arange(bs, dtype=torch.int64)
        else:
            seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int64)
            input_ids = torch.tensor(batch.input_ids, dtype=torch.int64)
            req_pool_indices = torch.tensor(batch.req_pool_indices, dtype=torch.int64)
            prefix = torch.tensor(prefix_cpu, dtype=torch.int64)
            extend_lens = torch.tensor(extend_cpu, dtype=torch.int64)
            start_loc = torch.zeros(bs, dtype=torch.int64)
            if bs > 1:
                start_loc[1:] = torch.cumsum(extend_lens[:-1], 0)
            # positions = concat(arange(prefix_i, seq_i)): a ramp per request
            req_of_token = torch.repeat_interleave(torch.arange(bs), extend_lens)
            positions = torch.arange(n_tokens, dtype=torch.int64) - start_loc[req_of_token]
            positions += prefix[req_of_token]
        # the step's tensors were built on the CPU: moved to the runner's device, or (a CPU runner) taken as they are
        on = (lambda t: t) if device.type == "cpu" else (lambda t: t.to(device))  # noqa: E731
        sampling_info = None
        if bs and not batch.forward_mode.is_idle():
            sampling_info = model_runner.sampler.info_memo.build(
                batch.sampling_params,
                batch.output_ids,
                vocab_size=model_runner.model_config.vocab_size,
                eos_token_ids=model_runner.model_config.eos_token_ids,
                device=device,
                prompt_ids=batch.prompt_ids,
                vocab_mask=batch.vocab_mask,
            )
        fb = cls(
            forward_mode=batch.forward_mode,
            batch_size=bs,
            input_ids=on(input_ids),
            positions=on(positions),
            req_pool_indices=on(req_pool_indices),
            seq_lens=on(seq_lens),
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens=on(extend_lens),
            extend_prefix_lens=on(prefix),
            extend_start_loc=on(start_loc),
            extend_seq_lens_cpu=extend_cpu,
            extend_prefix_lens_cpu=prefix_cpu,
            out_cache_loc=on(batch.out_cache_loc),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            sampling_info=sampling_info,
            return_logprob=batch.return_logprob,
            top_logprobs_nums=list(batch.top_logprobs_nums) or [0] * bs,
            prompt_logprob_targets=list(batch.prompt_logprob_targets) or [None] * bs,
            token_ids_logprobs=list(batch.token_ids_logprobs),
            capture_hidden_mode=batch.capture_hidden_mode,
            spec_info=batch.spec_info,
            num_extend_reqs=batch.num_extend_reqs,
            return_probs=batch.return_probs,
            lora_uids=batch.lora_uids,
            lora_batch=model_runner.lora_batch_for(batch.lora_uids, extend_cpu),
            mm_inputs=batch.mm_inputs,
            attn_q_last=(image_span_key_limits(positions, batch.mm_inputs, prefix_cpu, extend_cpu, device)
                         if batch.mm_inputs is not None and model_runner.image_spans_bidirectional else None),
            mrope_positions=(None if batch.mrope_inputs is None else
                             mrope_positions_of(positions, batch.mrope_inputs, extend_lens.tolist(), device)),
            kernel_mode=model_runner.kernel_mode,
            attn_backend=model_runner.attn_backend,
        )
        model_runner.attn_backend.init_forward_metadata(fb)
        return fb


def image_span_key_limits(positions: torch.Tensor, mm_inputs: list[MultimodalInputs | None], prefix_lens: list[int],
                          extend_lens: list[int], device: torch.device) -> torch.Tensor | None:
    """ForwardBatch.attn_q_last of a step: each row's own position, but the span's last position for a row of an
    image span (transformers' Gemma 3: OR(causal, same image block)). A span is computed whole in one step (the
    scheduler never ends a chunk inside one: managers/schedule_policy.py), else a row would miss keys computed
    after it. None when no row of the step is an image row."""
    last = None
    row = 0
    for mm, lo, n in zip(mm_inputs, prefix_lens, extend_lens):
        for item in mm.items if mm is not None else ():
            a, b = max(lo, item.offset), min(lo + n, item.end)
            if a >= b:
                continue
            if b != item.end:
                raise ValueError(f"a step ends inside image span [{item.offset}, {item.end}) at {lo + n}: its rows "
                                 "attend to the whole span, which must be computed in one step")
            last = positions.clone() if last is None else last
            last[row + a - lo : row + b - lo] = item.end - 1
        row += n
    return None if last is None else last.to(device)


def mrope_positions_of(positions: torch.Tensor, mrope_inputs: list[MultimodalInputs | None], rows_per_req: list[int],
                    device: torch.device) -> torch.Tensor:
    """ForwardBatch.mrope_positions: a text row's position thrice; a prompt row of a request with M-RoPE positions
    its column of them; a later row (an output token, decode or re-prefilled) its position + the request's delta."""
    out = positions.unsqueeze(0).repeat(3, 1)
    row = 0
    for mm, n in zip(mrope_inputs, rows_per_req):
        if mm is not None and mm.mrope_positions is not None:
            pos = positions[row : row + n]
            table = mm.mrope_positions
            part = out[:, row : row + n]
            part += mm.mrope_delta
            inside = pos < table.shape[1]
            part[:, inside] = table[:, pos[inside]]
        row += n
    return out.to(device)
