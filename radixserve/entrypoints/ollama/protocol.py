"""Pydantic models of Ollama's API (docs.ollama.com/api): /api/chat, /api/generate, /api/embed (and the legacy
/api/embeddings), /api/show, /api/tags, /api/ps, /api/version.

As in openai_protocol.py, the models check types only (a wrong type is a 400 naming the field); values are
checked where they are translated (options.py) or by the pipeline's one normaliser. Unknown top-level fields
are ignored, as Ollama's own server ignores them; Ollama fields this server does not implement (template,
context, suffix, think levels, ...) are refused by name in serving.py. `images` go to a vision-language model
(a text model refuses them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from radixserve.entrypoints.openai_protocol import _Request

# `keep_alive`: a duration ("5m", "0") or seconds; accepted, not applicable (the model stays loaded while the
# server runs). `format`: "json", "" or a JSON schema object. `think`: true / false (levels are refused).
KeepAlive = str | float | None
Format = str | dict[str, Any] | None


class ToolCallFunction(_Request):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object in Ollama, never a JSON string
    index: int | None = None


class ToolCall(_Request):
    id: str | None = None
    function: ToolCallFunction


class Message(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None  # an earlier answer's thinking: not sent to the template (docs/serving.md)
    images: list[str] | None = None  # base64 images (ollama/translate.with_images); a text model refuses them
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool message: the function whose result it carries


class _GenerationFields(_Request):
    model: str | None = None
    format: Format = None
    options: dict[str, Any] | None = None  # options.py says which are honoured and which are refused
    stream: bool | None = True  # Ollama streams unless told not to
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_GenerationFields):
    messages: list[Message] | None = None  # absent or empty: a "load the model" call, answered at once
    tools: list[dict[str, Any]] | None = None  # OpenAI's function-tool shape, checked by the chat route


class GenerateRequest(_GenerationFields):
    prompt: str | None = None  # absent or empty: a "load the model" call, answered at once
    system: str | None = None
    raw: bool | None = None  # true: the prompt as it is, no chat template
    suffix: str | None = None  # refused unless empty (fill-in-the-middle needs a template this server lacks)
    template: str | None = None  # refused: the server's chat template is the one used
    context: list[int] | None = None  # refused: the deprecated token-context continuation
    images: list[str] | None = None  # base64 images, as on a chat message


class EmbedRequest(_Request):
    model: str | None = None
    input: str | list[str]
    truncate: bool | None = True  # Ollama's default: an input over the context is cut to fit
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(_Request):
    """The legacy /api/embeddings: one prompt, one vector."""

    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ShowRequest(_Request):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool | None = None


# ---------------------------------------------------------------------------- responses
class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class Logprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] | None = None


class OutMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None


class _Timings(BaseModel):
    """The final object's counts and durations (nanoseconds), on every `done: true` answer."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[Logprob] | None = None


class ChatResponse(_Timings):
    message: OutMessage


class GenerateResponse(_Timings):
    response: str = ""
    thinking: str | None = None


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0


class EmbeddingsResponse(BaseModel):
    embedding: list[float]


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] = Field(default_factory=list)
    parameter_size: str = ""
    quantization_level: str = ""


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(BaseModel):
    models: list[ListedModel]


class RunningModel(ListedModel):
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str


class OllamaError(BaseModel):
    error: str


# the bodies the OpenAPI description declares (openapi_docs.install_openapi), which schemathesis fuzzes
SCHEMA_MODELS: list[type[BaseModel]] = [
    ChatRequest, ChatResponse, GenerateRequest, GenerateResponse, EmbedRequest, EmbedResponse, EmbeddingsRequest,
    EmbeddingsResponse, ShowRequest, ShowResponse, TagsResponse, PsResponse, VersionResponse, OllamaError,
]
