"""Messages between the TokenizerManager (main process) and the scheduler process (over ZMQ,
pickled). Every message is a dataclass built complete where it is sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """One generation call as any entry point receives it (Engine, /generate, the OpenAI routes).

    RequestNormalizer.normalize() turns it into validated TokenizedGenerateReqInputs: one per
    prompt x sample, in that order. Exactly one of text / input_ids; a list of prompts is a batch.
    `sampling_params` is a dict (one for all prompts) or a list of dicts (one per prompt); a key
    absent or None means the default.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_prompt_logprob: bool = False
    stream: bool = False
    priority: int = 0
    timeout: float | None = None  # seconds; None = the server's request_timeout
    lora_path: str | None = None  # LoRA adapter name (SGLang's field name); None = the base model
    # max_new_tokens when sampling_params has none: None = SamplingParams' default (128), -1 = until
    # the context is full. Either way clamped to what the context leaves (an explicit value is not).
    default_max_new_tokens: int | None = None
    # Text prompts (chat prompts too, after the template) get the tokenizer's own special tokens: a BOS
    # where its settings ask for one, never two (RequestNormalizer.tokenize).
    add_special_tokens: bool = True
    # SGLang's name: the logprobs (raw distribution) of these token ids at every position that predicts a
    # token after the prompt: one row per output token (the distribution it was drawn from), and with
    # max_new_tokens 0 the one row after the prompt, computed without sampling (what rerank and score read)
    token_ids_logprob: list[int] | None = None
    # images for the prompt's image placeholders, in order (SGLang's name): PIL images, encoded bytes, data:
    # URIs, paths / URLs where the server allows them (multimodal/image_loader.py); a batch: one list per prompt
    image_data: list[Any] | list[list[Any]] | None = None


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_prompt_logprob: bool = False
    stream: bool = False
    priority: int = 0
    timeout: float | None = None  # seconds from arrival at the scheduler; then aborted (HTTP 408)
    parent_rid: str | None = None  # the caller's rid when this is one of prompts x n sub-requests
    lora_path: str | None = None  # the LoRA adapter (its name) this request runs with; None = base model
    token_ids_logprob: list[int] | None = None  # see GenerateReqInput
    mm_inputs: Any = None  # multimodal/mm_inputs.MultimodalInputs: the prompt's image spans and pixels


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    rpc_id: int = 0
    storage: bool = False  # the disk tier too (--enable-hierarchical-cache)


@dataclass
class GetServerInfoReq:
    rpc_id: int = 0
    # Also the StepLog's records after this step (the web dashboard's poll; debug/step_log.py):
    # None = server info only. steps_rid keeps the records holding that request (its trace).
    steps_since: int | None = None
    steps_rid: str | None = None
    steps_limit: int = 64


@dataclass
class GetRadixTreeReq:
    """The radix tree as JSON, cut at max_nodes nodes / max_depth levels (mem_cache/radix_tree_view.py)."""

    rpc_id: int = 0
    max_nodes: int = 200
    max_depth: int = 32


@dataclass
class LoRAControlReq:
    """Load / unload / count the users of a LoRA adapter (lora/lora_scheduling.py LoRAScheduling.control)."""

    rpc_id: int = 0
    op: str = "list"  # load | unload | users | list
    name: str = ""
    path: str | None = None
    uid: int = 0  # users: the registration an unload returned


@dataclass
class ShutdownReq:
    """Stop the scheduler after its current step (the server's and the Engine's shutdown)."""


@dataclass
class RpcOutput:
    """Answer to a control request (flush, server info); rpc_id pairs it with its question, so a
    late answer to a call that timed out is never taken for the answer to the next one."""

    kind: str
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)
    rpc_id: int = 0
    dp_rank: int = 0  # the replica that answered (data parallel: every replica answers a broadcast call)


@dataclass
class ReqOutput:
    """What one request produced since its last output."""

    rid: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None
    meta_info: dict[str, Any]
    output_token_logprobs: list[float] = field(default_factory=list)  # aligned with new_token_ids
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: list[float] | None = None  # sent once, with the first output
    error: str | None = None  # a rejected or failed request: the message
    error_status: int = 400  # its HTTP status: 400 bad input, 408 timed out, 500 failed while running
    embedding: list[float] | None = None  # embedding server: the pooled, normalised vector (with the final output)
    # token_ids_logprob: per position since the last output, the logprobs of the asked ids, in their order
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)

    @classmethod
    def rejected(cls, rid: str, message: str, status: int = 400) -> ReqOutput:
        """A request refused before it was queued."""
        return cls(rid, [], {"type": "abort", "message": message}, {}, error=message, error_status=status)


@dataclass
class BatchReqOutput:
    outputs: list[ReqOutput]
