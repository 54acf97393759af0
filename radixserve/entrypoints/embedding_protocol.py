"""Pydantic models of POST /v1/embeddings (OpenAI's shape) and POST /tokenize, /detokenize (vLLM's and
SGLang's shapes). As in openai_protocol.py, request models check types only; values (dimensions, token
ids, counts) are checked once, in managers/embedding_request.py and the RequestNormalizer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from radixserve.entrypoints.openai_protocol import ChatMessage, _Request


# ---------------------------------------------------------------------------- /v1/embeddings
class EmbeddingRequest(_Request):
    # the order matters, as in CompletionRequest: pydantic's smart union keeps "abc" a str, [1, 2] token ids
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first `dimensions` components, renormalised
    user: str | None = None
    rid: str | None = None
    timeout: float | None = None  # seconds; the request is aborted after it (408)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: encoding_format base64 (float32, little-endian)
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(_Request):
    """vLLM's two forms in one: `prompt` (text; a list of texts, as SGLang takes) or `messages` (rendered
    by the chat template first, as /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    return_token_strs: bool = False  # vLLM: also each token's text


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int
    token_strs: list[str] | list[list[str]] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False  # False: detokenize(tokenize(x)) gives x back, special tokens included


class DetokenizeResponse(BaseModel):
    # `text` is SGLang's name, `prompt` vLLM's: both are sent, with the same value
    text: str | list[str]
    prompt: str | list[str]


# the bodies the OpenAPI description declares (openapi_docs.install_openapi)
SCHEMA_MODELS: list[type[BaseModel]] = [EmbeddingRequest, EmbeddingResponse, TokenizeRequest, TokenizeResponse,
                                        DetokenizeRequest, DetokenizeResponse]
