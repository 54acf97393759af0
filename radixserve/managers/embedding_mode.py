"""EmbeddingMode: what the scheduler does differently on an embedding server (--is-embedding).

A request is a prefill that finishes after its forward: it goes through the same queue, PrefillAdder
budgets (max_new_tokens 0: nothing is reserved for tokens it will never generate), chunking and radix
cache as a generation request, and many requests share one EXTEND step. After each step its pooled part
is accumulated (layers/pooler.py); after the step that computes its last prompt token it finishes, its KV
goes to the radix cache like a finished request's, and its output carries the normalised vector.

A sequence classifier (ModelConfig.num_labels) is served the same way: its vector is the `score` head's
logits at the last token (model_executor/embedding_forward.py), not normalised: what rerank and score read.

Prefix reuse: last-token pooling reuses a cached prefix (the last token is always computed, and its
hidden state depends on the prefix only through the KV, which is the same). Mean pooling needs every
token's hidden state, which the cache does not keep, so its requests never match a prefix
(Req.reuse_prefix = False): they recompute the whole prompt, and still insert their KV for nobody's harm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixserve.layers.pooler import accumulate, finalize
from radixserve.managers.failure_isolation import is_fatal
from radixserve.managers.req import FinishReason
from radixserve.model_executor.embedding_forward import EmbeddingBatchResult, forward_embedding

if TYPE_CHECKING:
    from radixserve.managers.failure_isolation import FailureIsolation
    from radixserve.managers.req import Req
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.model_executor.forward_batch_info import ModelWorkerBatch
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs


class EmbeddingMode:
    def __init__(self, pooling: str, runner: ModelRunner) -> None:
        self.pooling = pooling
        self.runner = runner
        self.reuse_prefix = pooling != "mean"  # Req.reuse_prefix of every request (see the module doc)
        # a sequence classifier: the vector is its last token's logits over the labels, never normalised
        self.classify = runner.model_config.num_labels > 0

    @classmethod
    def create(cls, server_args: ServerArgs, runner: ModelRunner) -> EmbeddingMode | None:
        labels = runner.model_config.num_labels
        if labels and not server_args.is_embedding:
            raise ValueError(f"is_embedding: this model is a sequence classifier ({labels} labels, no LM head): "
                             "serve it with --is-embedding (it answers /v1/rerank and /v1/score)")
        if labels and server_args.pooling != "last":
            raise ValueError(f"pooling: a sequence classifier scores its last token; got {server_args.pooling!r}")
        return cls(server_args.pooling, runner) if server_args.is_embedding else None

    def forward(self, mwb: ModelWorkerBatch) -> EmbeddingBatchResult:
        return forward_embedding(self.runner, mwb, self.pooling)

    def process_batch_result(self, batch: ScheduleBatch, result: EmbeddingBatchResult, tree_cache: BasePrefixCache,
                             isolation: FailureIsolation, finish: Callable[[Req, FinishReason], None]) -> None:
        """After a step: each request's pooled part; `finish` (the scheduler's) for the ones it completed.
        Nothing joins the running batch: every request is done or waits for its next chunk."""
        for i, req in enumerate(batch.reqs):
            try:
                if self._pool_one(req, batch.seq_lens[i], result.pooled[i], tree_cache):
                    finish(req, FinishReason("length", matched=None))
            except Exception as e:  # one request's bad output must not stop the others
                if is_fatal(e):
                    raise
                if not req.finished():
                    isolation.fail(req, batch.seq_lens[i], e, "while pooling its embedding")

    def _pool_one(self, req: Req, seq_len: int, part, tree_cache: BasePrefixCache) -> bool:
        """True when this step completed the request's vector."""
        req.kv_len = seq_len
        if req.finished():
            return False  # aborted while this step ran
        req.embed_acc = accumulate(req.embed_acc, part, self.pooling)
        if req.is_chunked:
            tree_cache.cache_unfinished_req(req)
            return False
        req.embedding = finalize(req.embed_acc, len(req.origin_input_ids), self.pooling, not self.classify)
        req.embed_acc = None
        return True
