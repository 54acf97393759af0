"""Messages between the TokenizerManager (main process) and the scheduler process (over ZMQ,
pickled). Every message is a dataclass built complete where it is sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling.sampling_params import SamplingParams


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


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetServerInfoReq:
    pass


@dataclass
class RpcOutput:
    """Answer to a control request (flush, server info)."""

    kind: str
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)


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
    error: str | None = None  # a rejected request: the message for a 400


@dataclass
class BatchReqOutput:
    outputs: list[ReqOutput]
