"""Req: one request's scheduling state, owned by the scheduler process.

Lengths of a request at any moment (DESIGN section 4):

    origin_input_ids      output_ids
    [p0 p1 ... pP-1]      [o0 o1 ... oN-1]
    |<---------- KV written ---------->|  oN-1 has no KV yet: the next DECODE writes it
    kv_len = P + N - 1 (after the first token is sampled)

During a chunked prefill `fill_ids` is the prompt prefix computed so far and
`prefix_indices` the KV slots the request already holds (tree-owned or its own).

A retracted request that `replay`s comes back with only its prompt prefilled and writes its outputs' KV in
decode steps (one a step, their sampled tokens dropped) until kv_len = P + N - 1 again: each of those
positions gets the decode path's bits, as when it was first decoded (the prefill path's attention rounds
differently), so retraction does not move a request's logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.mem_cache.cache_namespace import namespaced
from radixserve.multimodal.mm_inputs import MultimodalInputs
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.speculative.spec_info import Draft


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the EOS/stop token id or the stop string
    message: str | None = None  # abort reason

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message:
            out["message"] = self.message
        return out


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_prompt_logprob: bool = False
    stream: bool = False
    priority: int = 0  # larger runs first when policies tie (and under fcfs, before arrival)
    eos_token_ids: tuple[int, ...] = ()

    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens whose KV this request has written (tree-shared part included)
    swa_freed_len: int = 0  # a hybrid sliding-window pool: positions below it gave up their local KV
    # tokens of this request that came from the radix cache at its (first) admission
    cached_tokens: int = 0
    is_chunked: bool = False  # mid chunked prefill
    finished_reason: FinishReason | None = None
    to_abort: FinishReason | None = None
    num_retractions: int = 0
    replay: bool = False  # retracted: its outputs' KV is rebuilt by decode steps (module docstring)
    # perf_counter() time after which the request is aborted (HTTP 408); None = no limit
    deadline: float | None = None
    # set when the request failed or timed out: (HTTP status, message) for the client
    error: tuple[int, str] | None = None

    # logprobs (filled as tokens are produced)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: list[float] = field(default_factory=list)
    # token_ids_logprob (io_struct.GenerateReqInput): the ids asked for, and per predicting position their logprobs
    token_ids_logprob: list[int] | None = None
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)

    # bookkeeping for outputs streamed so far
    sent_len: int = 0
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    # speculative decoding (speculative/): the proposer's state for this request (an n-gram index, or
    # its row in the draft model's pool), its current draft length, the drafts of the verify step in
    # flight, and what verification gave (verify forwards in which it had drafts, tokens they produced)
    spec_state: Any = None
    spec_draft_len: int = -1  # -1: not set yet (the first verify step starts at the maximum)
    spec_retry_in: int = 0  # steps until a request whose draft length fell to 0 tries one token again
    spec_draft: Draft = field(default_factory=Draft)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    # constrained decoding (constrained/): the compile in flight while the request sits in the grammar
    # queue, then its matcher, which has accepted exactly output_ids
    grammar_future: Any = None
    grammar_queued_at: float = 0.0
    grammar: Any = None
    # reasoning (parser/thinking_gate.py): where the thinking ends; it holds req.grammar's place
    thinking: Any = None

    # embedding server (managers/embedding_mode.py): False = never match a cached prefix (mean pooling
    # needs every token's hidden state); the pooled value so far (across chunks); the final vector
    reuse_prefix: bool = True
    embed_acc: Any = None
    embedding: list[float] | None = None

    # LoRA (lora/lora_scheduling.py): the adapter this request runs with (None = base), its registration
    # uid (0 = base; also its radix cache namespace), whether it pins the weights (while admitted), and
    # whether it has stopped counting as the adapter's user (done)
    lora_name: str | None = None
    lora_uid: int = 0
    lora_pinned: bool = False
    lora_released: bool = False

    # images (multimodal/mm_inputs.py): their spans in origin_input_ids hold pad values above the vocabulary
    mm_inputs: MultimodalInputs | None = None
    vocab_size: int = 0  # where pad values start (set with mm_inputs)

    @classmethod
    def from_input(cls, recv: Any, eos_token_ids: tuple[int, ...], deadline: float | None, reuse_prefix: bool,
                   lora_name: str | None, lora_uid: int, vocab_size: int = 0) -> Req:
        """A request as the scheduler admits it, from its TokenizedGenerateReqInput."""
        return cls(rid=recv.rid, origin_input_ids=list(recv.input_ids), sampling_params=recv.sampling_params,
                   return_logprob=recv.return_logprob, top_logprobs_num=recv.top_logprobs_num,
                   return_prompt_logprob=recv.return_prompt_logprob, stream=recv.stream, priority=recv.priority,
                   eos_token_ids=eos_token_ids, deadline=deadline, reuse_prefix=reuse_prefix,
                   lora_name=lora_name, lora_uid=lora_uid, token_ids_logprob=recv.token_ids_logprob,
                   mm_inputs=recv.mm_inputs, vocab_size=vocab_size)

    # ------------------------------------------------------------------ state
    @property
    def vocab_input_ids(self) -> list[int]:
        """origin_input_ids as vocabulary ids (image spans read as the image token): what penalties and prompt
        logprobs index the vocabulary with."""
        if self.mm_inputs is None:
            return self.origin_input_ids
        return self.mm_inputs.to_vocab(self.origin_input_ids, self.vocab_size)

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline and not self.finished() and not self.to_abort

    def time_out(self) -> None:
        """Marked for abort with a 408; the scheduler returns its KV like any abort's."""
        timeout = self.deadline - self.created_time if self.deadline is not None else 0.0
        self.error = (408, f"timeout: the request did not finish within {timeout:.4g} s and was aborted")
        self.to_abort = FinishReason("abort", message="timeout")

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def prefill_ids(self) -> list[int]:
        """What a (re)admission computes by prefill: the prompt, plus the outputs of a retracted request that
        does not replay them."""
        return self.origin_input_ids if self.replay else self.origin_input_ids + self.output_ids

    def init_next_round_input(self) -> None:
        self.fill_ids = self.prefill_ids()

    @property
    def replaying(self) -> bool:
        """Its KV ends before its last output's position: the next decode steps rebuild it, their samples dropped."""
        return self.replay and self.kv_len < self.seqlen - 1

    @property
    def decode_len(self) -> int:
        """Positions the next decode step's query sees (it writes position decode_len - 1): seqlen, or one past
        the KV of a replaying request."""
        return self.kv_len + 1 if self.replaying else self.seqlen

    @property
    def decode_input_id(self) -> int:
        """The token the next decode step feeds: the last output, or a replaying request's next known token."""
        p = self.decode_len - 1
        n = len(self.origin_input_ids)
        return self.origin_input_ids[p] if p < n else self.output_ids[p - n]

    def prefix_match_key(self) -> list[int]:
        # NOTE: capped at len - 1 so at least one token is computed and there are logits to sample.
        if not self.reuse_prefix:
            return []
        # LoRA: keys carry the adapter's namespace (mem_cache/cache_namespace.py)
        return namespaced(self.fill_ids[: len(self.fill_ids) - 1], self.lora_uid)

    def reset_for_retract(self) -> None:
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.req_pool_idx = None
        self.kv_len = 0
        self.swa_freed_len = 0
        self.is_chunked = False
        self.num_retractions += 1
