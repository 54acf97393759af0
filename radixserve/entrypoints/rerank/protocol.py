"""Pydantic models of POST /v1/rerank (/rerank, /v2/rerank: Jina's and Cohere's shape, as vLLM and SGLang
serve it) and POST /v1/score (vLLM's shape). As in openai_protocol.py, request models check types only;
values (counts, top_n, lengths) are checked once, in serving.py."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from radixserve.entrypoints.openai_protocol import PromptTokensDetails, _Request


# ---------------------------------------------------------------------------- /v1/rerank
class RerankDocumentIn(_Request):
    """A document given as an object (Cohere's v1 / Jina's); only its text is read, other keys are ignored."""

    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str | RerankDocumentIn]
    top_n: int | None = None  # None: every document; more than there are: every document (Jina, Cohere)
    return_documents: bool = True  # each result carries its document's text (Jina's default)
    # the <Instruct> of the yes/no template (a causal LM reranker); None: Qwen3-Reranker's default instruction
    instruction: str | None = None


class RerankResultDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankResultDocument | None = None  # with return_documents


class RerankUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    # cached_tokens: prompt tokens the radix cache served (the query's prefix, shared by the documents)
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]  # by relevance_score, highest first
    usage: RerankUsage


# ---------------------------------------------------------------------------- /v1/score
class ScoreRequest(_Request):
    """vLLM's pairs: one text_1 against each text_2, or text_1[i] against text_2[i] (equal lengths)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None  # as in RerankRequest


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]  # in the order of the pairs
    usage: RerankUsage


# the bodies the OpenAPI description declares (openapi_docs.install_openapi), which schemathesis fuzzes
SCHEMA_MODELS: list[type[BaseModel]] = [RerankRequest, RerankResponse, ScoreRequest, ScoreResponse]
