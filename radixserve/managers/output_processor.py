"""Stop conditions and per-request outputs, on the scheduler side.

Stop strings are matched on decoded text, so the scheduler keeps a tokenizer; only the last few
tokens are decoded per step (a new match must end in the newest token), which keeps the check
O(stop length) instead of O(output length).
"""

from __future__ import annotations

import time
from typing import Any

from radixserve.constrained.grammar_queue import GrammarQueue
from radixserve.managers.io_struct import ReqOutput
from radixserve.managers.req import FinishReason, Req


class OutputProcessor:
    def __init__(self, tokenizer: Any, model_config: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.stream_interval = max(1, stream_interval)
        self.pending: list[Req] = []  # requests with something to send this step
        self.generated_tokens = 0  # every token append_token took (get_server_info's generation_tokens)

    def append_token(self, req: Req, token: int, sample: Any, row: int) -> FinishReason | None:
        """The one path a sampled token takes into a request (a DECODE / PREFILL step's row, or each verified
        token of a TARGET_VERIFY step): appended with its logprobs (`row` of `sample`), then the stop checks
        and the grammar's move; the reason it finished, or None."""
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self.generated_tokens += 1
        if sample.next_token_logprobs is not None and req.return_logprob:
            req.output_token_logprobs.append(sample.next_token_logprobs[row])
            if req.top_logprobs_num and sample.top_logprobs is not None:
                req.output_top_logprobs.append(sample.top_logprobs[row])
        self.add_token_ids_logprobs(req, sample, row)
        reason = self.check_finished(req, self.model_config.context_len)
        if req.grammar is not None:
            reason = GrammarQueue.advance(req, token, reason)
        return reason

    @staticmethod
    def add_token_ids_logprobs(req: Req, sample: Any, row: int) -> None:
        """The logprobs of req.token_ids_logprob at the position `row` of `sample` predicted from."""
        if req.token_ids_logprob and sample.token_ids_logprobs is not None:
            req.output_token_ids_logprobs.append(sample.token_ids_logprobs[row])

    def check_finished(self, req: Req, context_len: int) -> FinishReason | None:
        params = req.sampling_params
        token = req.output_ids[-1]
        if token in params.stop_token_ids:
            return FinishReason("stop", matched=token)
        if not params.ignore_eos and token in req.eos_token_ids:
            return FinishReason("stop", matched=token)
        if params.stop:
            matched = self._match_stop_str(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        if req.seqlen >= context_len:
            return FinishReason("length", message="context length reached")
        return None

    def _match_stop_str(self, req: Req) -> str | None:
        stops = req.sampling_params.stop
        # A stop string of L characters spans at most L tokens (+1 for a token that starts it
        # mid-way); decode that window only.
        window = max(len(s) for s in stops) + 1
        text = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        # Only matches that end in the newest token are new; earlier ones were already checked.
        prev = self.tokenizer.decode(req.output_ids[-window:-1], skip_special_tokens=False)
        for s in stops:
            if s in text and not (s in prev):
                return s
        return None

    def maybe_stream(self, req: Req) -> None:
        if req.stream and (len(req.output_ids) - req.sent_len) >= self.stream_interval:
            self.pending.append(req)

    def flush(self) -> list[ReqOutput]:
        outs = [self._make_output(r) for r in self.pending]
        self.pending = []
        return outs

    def _make_output(self, req: Req) -> ReqOutput:
        new_ids = req.output_ids[req.sent_len :]
        first = req.sent_len == 0
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        now = time.perf_counter()
        meta: dict[str, Any] = {
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "num_retractions": req.num_retractions,
        }
        if req.spec_verify_ct:
            meta["spec_verify_ct"] = req.spec_verify_ct  # verify forwards of this request
            meta["spec_accept_length"] = req.spec_accepted_tokens / req.spec_verify_ct  # tokens per verify
        if req.thinking is not None:  # usage.completion_tokens_details.reasoning_tokens
            meta["reasoning_tokens"] = req.thinking.reasoning_tokens
        if req.first_token_time is not None:
            # measured where the token is produced, so it is right for non-streamed requests too
            meta["ttft"] = req.first_token_time - req.created_time
        if req.finished_reason is not None:
            meta["finish_reason"] = req.finished_reason.to_json()
            meta["e2e_latency"] = now - req.created_time
        status, message = req.error if req.error is not None else (400, None)
        return ReqOutput(
            error=message,
            error_status=status,
            rid=req.rid,
            new_token_ids=list(new_ids),
            finished_reason=req.finished_reason.to_json() if req.finished_reason else None,
            meta_info=meta,
            output_token_logprobs=req.output_token_logprobs[start:] if req.return_logprob else [],
            output_top_logprobs=req.output_top_logprobs[start:] if req.return_logprob else [],
            input_token_logprobs=list(req.input_token_logprobs) if (first and req.return_prompt_logprob) else None,
            embedding=req.embedding,
            output_token_ids_logprobs=req.output_token_ids_logprobs[start:] if req.token_ids_logprob else [],
        )
