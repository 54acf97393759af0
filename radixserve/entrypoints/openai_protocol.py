"""Pydantic models of the HTTP API: OpenAI's completions / chat shapes and the native /generate.

Request models check *types* only (a wrong type becomes a 400 naming the field); value ranges
are checked once, by SamplingParams.verify, so the HTTP API, the offline Engine and the
scheduler agree on what is valid. Unknown fields are ignored, as the OpenAI SDK sends fields
(user, store, metadata, ...) that have no meaning here.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # Unknown fields are kept (not validated) so that the handlers can refuse the ones this server
    # does not implement by name (serving_base.UNSUPPORTED_*); the rest (user, store, metadata...)
    # have no meaning here and are ignored, as the OpenAI SDK sends them.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow BaseModel.schema(); the JSON key is still "schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model: str | None = None
    # NOTE: None (JSON null, which some clients send for "unset") means the SamplingParams default.
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # extras (vLLM / SGLang spellings)
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    timeout: float | None = None  # seconds; the request is aborted after it (408)
    # structured output: OpenAI's response_format, SGLang's native names and vLLM's guided_* (one at most)
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; the order matters: pydantic's smart union
    # keeps "abc" a str and [1, 2] a list of ints.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: OpenAI's documented default for completions, 16
    logprobs: int | None = None  # top-k alternatives per token (0..20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, or OpenAI content parts [{"type": "text", "text": ...}]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent = no parameters
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None = until EOS or the context is full
    max_completion_tokens: int | None = None  # the newer OpenAI name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    user: str | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # reasoning (parser/reasoning_request.py checks them)
    separate_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = None
    max_thinking_tokens: int | None = None  # alias of thinking_budget


class GenerateRequest(_Request):
    """Native SGLang-style request: POST /generate."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_prompt_logprob: bool = False
    rid: str | None = None
    timeout: float | None = None
    lora_path: str | None = None  # a loaded LoRA adapter's name (SGLang's field); None = the base model
    # SGLang's field: the logprobs of these ids at each predicting position (meta_info.output_token_ids_logprobs)
    token_ids_logprob: list[int] | None = None


class AbortRequest(_Request):
    rid: str | None = None
    abort_all: bool = False


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # SGLang extra: the stop string / token that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser (SGLang / DeepSeek's name)
    reasoning: str | None = None  # the same text: vLLM's newer name
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then {"content": "..."}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    root: str | None = None
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base itself


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
