"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

The request models check the top-level types (a wrong type is a 400 naming the field); content blocks,
tools, tool_choice and thinking stay plain objects here and are checked block by block in translate.py,
so that an error names the exact place (`messages.2.content.0.tool_use_id`) rather than pydantic's
union branches. Unknown top-level fields are kept so that translate.py can refuse the features this
server does not build by name; the rest (Anthropic's operational knobs) are ignored, as docs/serving.md lists.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # the chat route's bound on tools per request
_STR_OR_BLOCKS: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicInputMessage(_Request):
    role: Literal["user", "assistant"]
    # a string, or blocks: text, tool_use (assistant), tool_result (user), thinking (assistant history);
    # checked in translate.py, whose errors name the block (pydantic's would name a union branch)
    content: Any = Field(json_schema_extra=_STR_OR_BLOCKS)


class _Prompt(_Request):
    """What both routes render: the conversation, the system prompt, the tools and the thinking switch."""

    model: str
    messages: list[AnthropicInputMessage] = Field(min_length=1)
    system: Any = Field(default=None, json_schema_extra=_STR_OR_BLOCKS)  # a string or text blocks
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", ...}
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}


class AnthropicMessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used (one tenant)


class AnthropicCountTokensRequest(_Prompt):
    pass


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicUsage(BaseModel):
    # Anthropic's convention: input_tokens are the prompt tokens NOT read from the cache; the prompt is
    # input_tokens + cache_creation_input_tokens + cache_read_input_tokens (the radix cache writes no
    # separately billed entries, so creation is always 0)
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]  # text, thinking (with signature) and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                         "model_context_window_exceeded"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
