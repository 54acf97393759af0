"""Pydantic models of OpenAI's Responses API: the request, its input items and the response object.

Like the chat models they check types only; value rules (budgets, lengths, the context) are checked once, by
the chat pipeline the request is translated onto (translate.py). Unknown fields are kept so that the ones this
server does not build can be refused by name (serving.py's UNSUPPORTED), the rest ignored as the SDK sends new
ones with every release.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixserve.entrypoints.openai_protocol import FunctionDef

MAX_TOOLS = 128  # the chat route's bound on tools
MAX_INPUT_ITEMS = 4096  # a conversation longer than this does not fit any context either


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------- input items
class InputMessage(_Request):
    """A message: `content` is a string or parts (input_text / output_text; images refused)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class FunctionCallInput(_Request):
    """An earlier call of the model's, as it came back in `output` (its arguments are JSON text)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(_Request):
    """The client's result of a call: `call_id` must name a function_call earlier in the conversation."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningInput(_Request):
    """An earlier turn's reasoning item, sent back as clients do (Codex): accepted, not re-rendered."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


INPUT_ITEMS: dict[str, type[_Request]] = {"message": InputMessage, "function_call": FunctionCallInput,
                                          "function_call_output": FunctionCallOutputInput,
                                          "reasoning": ReasoningInput}


# ---------------------------------------------------------------------------- the request
class FunctionTool(FunctionDef):
    """A function tool in the Responses API's flat shape (name and parameters beside `type`)."""

    type: Literal["function"]


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow BaseModel.schema(); the JSON key is still "schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of summary


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    stream: bool | None = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        # a clearer 400 than pydantic's per-member union errors ("input.str: ...")
        if not isinstance(value, (str, list)):
            raise ValueError("must be a string or a list of input items")  # noqa: TRY004  # pydantic wants ValueError
        if isinstance(value, list) and len(value) > MAX_INPUT_ITEMS:
            raise ValueError(f"at most {MAX_INPUT_ITEMS} items, got {len(value)}")
        return value


# ---------------------------------------------------------------------------- the response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)  # no summary is written: the thinking is in `content`
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    output_text: str = ""  # the SDKs' convenience, also here for raw HTTP clients
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
