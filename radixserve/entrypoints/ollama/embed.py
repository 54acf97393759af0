"""POST /api/embed (and the legacy /api/embeddings): Ollama's embeddings, through /v1/embeddings' handler
(OpenAIServingEmbedding.embed: the same normaliser, the embedding-mode scheduler, the pooled and normalised
vectors). On a generation server both are the 400 /v1/embeddings answers there.

`truncate` (Ollama's default true) cuts an input longer than the context to its first tokens that fit, as
Ollama does; false leaves it whole, and one that does not fit is a 400 naming `input`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.embedding_protocol import EmbeddingRequest
from radixserve.entrypoints.ollama.options import embedding_options
from radixserve.entrypoints.ollama.protocol import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    EmbedResponse,
)
from radixserve.entrypoints.ollama.translate import Clock
from radixserve.entrypoints.openai_serving import APIError, parse_body
from radixserve.entrypoints.serving_embedding import embedding_api_error
from radixserve.managers.embedding_request import check_server_kind


class OllamaEmbedding:
    def __init__(self, servings: dict[str, Any], resolve: Any) -> None:
        self.serving = servings["embeddings"]  # OpenAIServingEmbedding
        self.tm = self.serving.tm
        self.resolve = resolve  # OllamaServing.resolve: the served name, or Ollama's 404

    async def embed(self, request: Request) -> Response:
        clock = Clock()
        req: EmbedRequest = await parse_body(request, EmbedRequest)
        base = self.resolve(req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        vectors, prompt_tokens = await self._vectors(base, texts, req.truncate is not False, req.dimensions,
                                                     req.options, request)
        timings = clock.timings(prompt_tokens, 0)
        return JSONResponse(EmbedResponse(model=req.model or base, embeddings=vectors,
                                          total_duration=timings["total_duration"],
                                          prompt_eval_count=prompt_tokens).model_dump())

    async def embeddings(self, request: Request) -> Response:
        """The legacy call. NOTE: Ollama's returned the raw (unnormalised) vector; this one is the same
        normalised vector /api/embed gives (the pooling the server was started with)."""
        req: EmbeddingsRequest = await parse_body(request, EmbeddingsRequest)
        base = self.resolve(req.model)
        if not req.prompt:  # Ollama answers an empty prompt with an empty vector
            self._check_kind()
            return JSONResponse(EmbeddingsResponse(embedding=[]).model_dump())
        vectors, _ = await self._vectors(base, [req.prompt], True, None, req.options, request)
        return JSONResponse(EmbeddingsResponse(embedding=vectors[0]).model_dump())

    def _check_kind(self) -> None:
        try:
            check_server_kind(self.tm.server_args.is_embedding, True)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _vectors(self, model: str, texts: list[str], truncate: bool, dimensions: int | None,
                       options: dict[str, Any] | None, request: Request) -> tuple[list[list[float]], int]:
        self._check_kind()  # before tokenizing anything: a generation server says what it is
        embedding_options(options, self.tm.limits.context_len)
        if not texts:
            raise APIError(400, "input: the list of inputs is empty", "input")
        if len(texts) > self.tm.limits.max_prompts:
            raise APIError(400, f"input: at most {self.tm.limits.max_prompts} inputs per call, got {len(texts)}",
                           "input")
        value: Any = texts
        if truncate:
            keep = self.tm.limits.max_req_len - 1  # an embedding still needs a prompt shorter than the limit
            try:
                value = [self.tm.normalizer.tokenize(t)[:keep] for t in texts]
            except ValueError as e:
                raise embedding_api_error(e) from None
        resp = await self.serving.embed(EmbeddingRequest(model=model, input=value, dimensions=dimensions),
                                           request)
        return [d.embedding for d in resp.data], resp.usage.prompt_tokens
