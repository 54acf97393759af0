"""POST /v1/embeddings: OpenAI's embeddings API on an embedding server (--is-embedding).

    {"input": "text" | ["a", "b"] | [1, 2, 3] | [[1, 2], [3]], "model": ..., "encoding_format": "float"|"base64",
     "dimensions": 256}
    -> {"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": i}], "model": ...,
        "usage": {"prompt_tokens": N, "total_tokens": N}}

Every input is one scheduler request (managers/embedding_request.py turns the call into the generation
path's GenerateReqInput, so the same normaliser bounds it); the scheduler batches them into shared EXTEND
steps, and the radix cache serves repeated prefixes under last-token pooling.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from radixserve.entrypoints.openai_serving import APIError, RequestGroup, parse_body
from radixserve.entrypoints.serving_base import OpenAIServingBase
from radixserve.managers.embedding_request import check_options, embedding_input, encode_vector

# the normaliser's field names -> the field an embeddings client sent
EMBEDDING_RENAMES = {"prompt": "input", "input_ids": "input"}
_OWN_FIELDS = ("input", "dimensions", "encoding_format")


def embedding_api_error(e: ValueError) -> APIError:
    """A 400 naming the client's field: this API's own (input, dimensions, ...) or a renamed normaliser one."""
    head = str(e).split(" ", 1)[0].rstrip(":")
    if head in _OWN_FIELDS:
        return APIError(400, str(e), head)
    return APIError.from_value_error(e, EMBEDDING_RENAMES)


class OpenAIServingEmbedding(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        return JSONResponse((await self.embed(req, request)).model_dump())

    async def embed(self, req: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        """The vectors `req` asks for (also the API surfaces' embeddings: Ollama's /api/embed)."""
        self.check_model(req.model)
        rid = req.rid or f"embd-{uuid.uuid4().hex}"
        try:
            obj = embedding_input(req.input, rid=rid, timeout=req.timeout)
            subs, _ = self.tm.normalize(obj, embed=True)
            check_options(req.dimensions, req.encoding_format, self.tm.hidden_size)
        except ValueError as e:
            raise embedding_api_error(e) from None
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        data = []
        for i, out in enumerate(outs):
            if "embedding" not in out:  # aborted (/abort_request): no vector was pooled
                raise APIError(409, f"input {i} was aborted before its embedding was computed",
                               code="request_aborted")
            data.append(EmbeddingData(index=i, embedding=encode_vector(out["embedding"], req.dimensions,
                                                                        req.encoding_format)))
        prompt_tokens = sum(out["meta_info"].get("prompt_tokens", 0) for out in outs)
        return EmbeddingResponse(data=data, model=self.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
