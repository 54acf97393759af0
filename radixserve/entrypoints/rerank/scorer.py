"""Scorer: (query, document) pairs -> relevance scores, through the one pipeline every request takes.

    pairs -> prompts (template.py) -> GenerateReqInput(input_ids = the prompts, max_new_tokens 0)
          -> TokenizerManager.normalize (the same bounds as every call) -> the scheduler, in waves of at most
             --max-prompts-per-request prompts; each wave's prompts share EXTEND steps, and the radix cache
             serves the query prefix they start with
          -> yes/no: each prompt's logprobs of "yes" and "no" after its last token (token_ids_logprob: the
             scheduler computes the step's logits and samples nothing); classifier: its label logits
             (an --is-embedding server's pooled vector, managers/embedding_mode.py)
          -> scores, in the order of the pairs

Which kind a server is follows from what it serves: a generation server reranks by yes/no, an
--is-embedding server of a *ForSequenceClassification checkpoint by its head; an embedding model without a
head is refused (a 400 that says so).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from radixserve.entrypoints.openai_serving import APIError, RequestGroup
from radixserve.entrypoints.rerank.template import (
    YesNo,
    classifier_score,
    pair_prompts,
    query_text,
    yes_no_prompts,
)
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager


@dataclass
class Scores:
    scores: list[float]
    prompt_tokens: int
    cached_tokens: int


class Scorer:
    def __init__(self, tm: TokenizerManager, is_embedding: bool, metrics: Any = None) -> None:
        self.tm, self.metrics = tm, metrics
        self.tokenizer = tm.tokenizer
        self.is_embedding = is_embedding
        self.yes_no = None if is_embedding else YesNo.of(tm.tokenizer)
        # NOTE: a token spells at most this many characters, so a text longer than limit * this is too long
        # without tokenising it (a 5 MB query is refused at once, not after seconds of tokenising)
        self.max_token_chars = max(map(len, tm.tokenizer.get_vocab()), default=1)

    def check_servable(self) -> None:
        """Raise the 400 that says why this server cannot score, if it cannot."""
        labels = self.tm.num_labels
        if self.is_embedding and not labels:
            raise APIError(400, "this embedding server's model has no classification head: reranking needs a "
                           "causal LM (scored by its yes/no logits) or a *ForSequenceClassification checkpoint")
        if self.is_embedding and labels != 1:
            raise APIError(400, f"this classifier has {labels} labels: reranking reads a one-label (relevance) head")
        if not self.is_embedding and self.yes_no is None:
            raise APIError(400, "this model's tokenizer has no single 'yes' and 'no' tokens: the yes/no reranker "
                           "cannot read their logits")

    async def score(self, pairs: list[tuple[str, str]], instruction: str | None, request: Request | None,
                    query_field: str, document_field: str) -> Scores:
        """Scores of the (query, document) pairs; a too-long query or document is a 400 naming its field
        (`query_field` / `document_field`[i])."""
        self.check_servable()
        prompts = self._prompts(pairs, instruction, query_field, document_field)
        rid = f"rerank-{uuid.uuid4().hex}"
        wave = self.tm.limits.max_prompts
        scores: list[float] = []
        prompt_tokens = cached_tokens = 0
        for start in range(0, len(prompts), wave):
            outs = await self._run(prompts[start : start + wave], f"{rid}-{start}", request)
            for i, out in enumerate(outs):
                scores.append(self._read(out, start + i, document_field))
                prompt_tokens += out["meta_info"].get("prompt_tokens", 0)
                cached_tokens += out["meta_info"].get("cached_tokens", 0)
        return Scores(scores, prompt_tokens, cached_tokens)

    def _prompts(self, pairs: list[tuple[str, str]], instruction: str | None, query_field: str,
                 document_field: str) -> list[list[int]]:
        limit = self.tm.limits.max_req_len  # a prompt must leave room for the one position it predicts
        within = self.tm.limits.limit_name()
        queries = {q: i for i, (q, _) in enumerate(pairs)}
        for q, i in queries.items():  # each query alone first: a huge one is refused before any pairing
            field = query_field if len(queries) == 1 else f"{query_field}[{i}]"
            text = q if self.is_embedding else query_text(q, instruction)
            n = len(text) // self.max_token_chars if len(text) > limit * self.max_token_chars else \
                len(self.tokenizer.encode(text, add_special_tokens=False))
            if n >= limit:
                raise APIError(400, f"{field}: at least {n} tokens (with the reranking template) leave no room for "
                               f"a document within {within}", field)
        for i, (_, d) in enumerate(pairs):
            if len(d) > limit * self.max_token_chars:
                field = f"{document_field}[{i}]"
                raise APIError(400, f"{field}: {len(d)} characters is longer than {within} allows", field)
        if self.is_embedding:
            prompts = pair_prompts(self.tokenizer, pairs)
        else:
            prompts = yes_no_prompts(self.tokenizer, pairs, instruction)
        for i, ids in enumerate(prompts):
            if len(ids) >= limit:
                field = f"{document_field}[{i}]"
                raise APIError(400, f"{field}: the pair is {len(ids)} tokens, longer than {within} allows", field)
        return prompts

    async def _run(self, prompts: list[list[int]], rid: str, request: Request | None) -> list[dict[str, Any]]:
        obj = GenerateReqInput(input_ids=prompts, rid=rid, sampling_params={"max_new_tokens": 0},
                               token_ids_logprob=None if self.yes_no is None else self.yes_no.ids)
        try:
            subs, _ = self.tm.normalize(obj, classify=self.is_embedding)
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        try:
            return await group.results(request)
        finally:
            group.cancel()

    def _read(self, out: dict[str, Any], i: int, document_field: str) -> float:
        if self.is_embedding:
            logits = out.get("embedding")
            if logits is None:
                raise APIError(409, f"{document_field}[{i}] was aborted before it was scored", code="request_aborted")
            return classifier_score(logits)
        rows = out["meta_info"].get("output_token_ids_logprobs")
        if not rows:
            raise APIError(409, f"{document_field}[{i}] was aborted before it was scored", code="request_aborted")
        return YesNo.score(rows[0])
