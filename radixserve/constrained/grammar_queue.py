"""GrammarQueue: constrained requests wait here, outside the waiting queue, until their grammar has
compiled, so a compile never holds up the scheduler loop or the requests queued behind it.

Each step the scheduler takes the ready ones (-> waiting queue, with their matcher) and the failed
ones (-> finished with a 400 naming the constraint). Under tensor parallelism every rank compiles
on its own, and one rank may finish first; the ranks agree on who is ready with one MIN all-reduce
of the ready flags, only in steps where the queue is not empty, so every rank admits the same
requests in the same step.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.constrained.grammar_spec import GrammarSpec, short_error
from radixserve.constrained.xgrammar_backend import XGrammarBackend
from radixserve.managers.req import FinishReason, Req
from radixserve.model_loader import resolved_tokenizer
from radixserve.parser.thinking_gate import wrap_compiled


class GrammarQueue:
    def __init__(self, server_args: Any, tokenizer: Any, model_config: Any, parallel_state: Any = None) -> None:
        self.server_args = server_args
        self.tokenizer, self.model_config = tokenizer, model_config
        self.timeout_s = server_args.grammar_compile_timeout
        self.parallel_state = parallel_state
        self._backend: XGrammarBackend | None = None
        self.reqs: list[Req] = []
        self.num_admitted = 0
        self.compile_wait_s = 0.0  # time requests spent here, summed (get_server_info)

    @property
    def backend(self) -> XGrammarBackend:
        """Built on the first constrained request: the vocabulary scan takes ~0.3 s that a server
        without such requests never needs to pay."""
        if self._backend is None:
            mc = self.model_config
            self._backend = XGrammarBackend(resolved_tokenizer(self.tokenizer), mc.vocab_size, mc.eos_token_ids,
                                            self.server_args.grammar_cache_size)
        return self._backend

    def add(self, req: Req, spec: GrammarSpec, now: float) -> None:
        req.grammar_future = self.backend.compile_async(spec)
        req.grammar_queued_at = now
        self.reqs.append(req)

    def remove(self, req: Req) -> None:
        self.reqs.remove(req)
        req.grammar_future = None

    def pop_ready(self, now: float) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, with req.grammar set; the others that failed or ran out
        of time, finished with a 400 naming the constraint). The rest keep waiting."""
        if not self.reqs:
            return [], []
        done = [r.grammar_future.done() or now - r.grammar_queued_at > self.timeout_s for r in self.reqs]
        ps = self.parallel_state
        if ps is not None and ps.world_size > 1:  # every rank admits a request at the same step
            flags = ps.all_reduce_min(torch.tensor(done, dtype=torch.int32))
            done = [bool(x) for x in flags.tolist()]
        ready: list[Req] = []
        failed: list[Req] = []
        waiting: list[Req] = []
        for req, ok in zip(self.reqs, done):
            if not ok:
                waiting.append(req)
                continue
            fut, req.grammar_future = req.grammar_future, None
            self.compile_wait_s += now - req.grammar_queued_at
            if not fut.done():
                kind = req.sampling_params.constraint().kind
                why = f"{kind}: the grammar did not compile within {self.timeout_s:g} s (--grammar-compile-timeout)"
                failed.append(_failed(req, why))
                continue
            err = fut.exception()
            if err is not None:
                spec = req.sampling_params.constraint()
                failed.append(_failed(req, f"{spec.kind}: the grammar failed to compile: {short_error(err)}"))
                continue
            req.grammar = self.backend.new_grammar(fut.result())
            wrap_compiled(req)  # with a reasoning parser the grammar starts after the thinking
            # a request retracted earlier never comes back here; one that was queued first has
            # generated nothing yet, so the fresh matcher has accepted exactly its output_ids
            ready.append(req)
        self.num_admitted += len(ready)
        self.reqs = waiting
        return ready, failed

    @staticmethod
    def advance(req: Req, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        """The request accepted `token_id`: move its matcher on. The grammar's end is a stop even
        with ignore_eos (past its end nothing is valid)."""
        if not req.grammar.accept(token_id):
            if not req.grammar.allows_any_token():
                # the mask allowed nothing, so the sampler's pick is meaningless: the constraint, not
                # the server, is at fault (400), and the request ends here
                spec = req.sampling_params.constraint()
                return _failed(req, f"{spec.kind if spec else 'grammar'}: the constraint admits no token after {len(req.output_ids) - 1} "
                                    "generated tokens (this model's vocabulary cannot continue it)").finished_reason
            # the mask allowed only valid tokens, so this is a bug; the request fails alone (500)
            raise RuntimeError(f"token {token_id} violates the request's grammar")
        if reason is None and req.grammar.is_terminated():
            return FinishReason("stop", matched=token_id)
        return reason

    def info(self) -> dict[str, Any]:
        b = self._backend
        return {
            "num_grammar_queue_reqs": len(self.reqs),
            "grammar": {
                "num_admitted": self.num_admitted,
                "compile_wait_s": self.compile_wait_s,
                "compiled": b.stats["compiled"] if b else 0,
                "cache_hits": b.stats["cache_hits"] if b else 0,
            },
        }


def _failed(req: Req, message: str) -> Req:
    req.error = (400, message)
    req.finished_reason = FinishReason("abort", message=message)
    return req
