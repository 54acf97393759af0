"""POST /v1/rerank (/rerank, /v2/rerank) and POST /v1/score: the request's shape -> (query, document) pairs
-> Scorer (scorer.py) -> the response's shape.

    rerank  {"query": q, "documents": ["a" | {"text": "a"}, ...], "top_n": k, "return_documents": true}
            -> {"id", "model", "results": [{"index", "relevance_score", "document": {"text"}}] (highest first,
                the first top_n), "usage": {"prompt_tokens", "total_tokens", "prompt_tokens_details"}}
    score   {"text_1": q | [q...], "text_2": d | [d...]}: one text_1 against each text_2, or pairwise
            -> {"id", "object": "list", "model", "data": [{"index", "object": "score", "score"}], "usage"}

Bounds: at most --max-rerank-documents documents (pairs); top_n in [1, that cap]; no empty list; a query or
document beyond the context is a 400 naming it (the body itself is capped by --max-request-body-bytes).
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import PromptTokensDetails
from radixserve.entrypoints.openai_serving import APIError, parse_body
from radixserve.entrypoints.rerank.protocol import (
    RerankDocumentIn,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankResultDocument,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from radixserve.entrypoints.rerank.scorer import Scorer, Scores
from radixserve.entrypoints.serving_base import OpenAIServingBase


def _usage(s: Scores) -> RerankUsage:
    return RerankUsage(prompt_tokens=s.prompt_tokens, total_tokens=s.prompt_tokens,
                       prompt_tokens_details=PromptTokensDetails(cached_tokens=s.cached_tokens))


class RerankServing(OpenAIServingBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = Scorer(self.tm, self.server_args.is_embedding, self.metrics)
        self.max_documents = self.server_args.max_rerank_documents

    def _check(self, model: str | None, instruction: str | None, count: int, field: str) -> None:
        self.check_model(model)
        if self.server_args.is_embedding and instruction is not None:
            raise APIError(400, "instruction: a classifier reads the tokenizer's pair encoding, which has no "
                           "instruction (it is the yes/no template's)", "instruction")
        if count == 0:
            raise APIError(400, f"{field}: the list is empty", field)
        if count > self.max_documents:
            raise APIError(400, f"{field}: at most {self.max_documents} per request (--max-rerank-documents), "
                           f"got {count}", field)

    async def rerank(self, request: Request) -> Response:
        req: RerankRequest = await parse_body(request, RerankRequest)
        docs = [d.text if isinstance(d, RerankDocumentIn) else d for d in req.documents]
        self._check(req.model, req.instruction, len(docs), "documents")
        top_n = len(docs) if req.top_n is None else req.top_n
        if not 1 <= top_n <= self.max_documents:
            raise APIError(400, f"top_n: must be in [1, {self.max_documents}] (more than the documents returns "
                           f"them all), got {top_n}", "top_n")
        s = await self.scorer.score([(req.query, d) for d in docs], req.instruction, request, "query", "documents")
        order = sorted(range(len(docs)), key=lambda i: -s.scores[i])[:top_n]  # stable: ties keep request order
        results = [RerankResult(index=i, relevance_score=s.scores[i],
                                document=RerankResultDocument(text=docs[i]) if req.return_documents else None)
                   for i in order]
        resp = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.model_name, results=results,
                              usage=_usage(s))
        return JSONResponse(resp.model_dump(exclude_none=True))

    async def score(self, request: Request) -> Response:
        req: ScoreRequest = await parse_body(request, ScoreRequest)
        firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        self._check(req.model, req.instruction, len(firsts), "text_1")
        self._check(req.model, req.instruction, len(seconds), "text_2")
        if len(firsts) == 1:  # vLLM: one text_1 scores against every text_2
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise APIError(400, f"text_2: {len(seconds)} texts for {len(firsts)} text_1 (give one text_1, or as "
                           "many as text_2)", "text_2")
        s = await self.scorer.score(list(zip(firsts, seconds)), req.instruction, request, "text_1", "text_2")
        data = [ScoreData(index=i, score=x) for i, x in enumerate(s.scores)]
        resp = ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=self.model_name, data=data, usage=_usage(s))
        return JSONResponse(resp.model_dump())
