"""A Responses request -> the chat route's ChatCompletionRequest, and the chat answer -> Responses output.

The fields map one to one onto the chat pipeline (chat template, tool and reasoning parsers, grammars):

    instructions + input items    messages (input_items.py)
    tools (flat function tools)   tools; built-in tool types (web_search, file_search, ...) skipped, logged
    tool_choice                   tool_choice (auto / none / required / a named function)
    text.format                   response_format (json_schema / json_object; text = none)
    max_output_tokens             max_completion_tokens (the reasoning counts against it, as OpenAI's)
    reasoning.effort              thinking_budget: a share of the output room (EFFORT_SHARE)
    temperature, top_p, parallel_tool_calls, user    the same fields

Errors the chat pipeline raises name its fields; CHAT_NAMES renames them to the ones the client sent.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from pydantic import ValidationError

from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    FunctionDef,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolDef,
    UsageInfo,
)
from radixserve.entrypoints.openai_serving import APIError
from radixserve.entrypoints.responses.protocol import (
    FunctionCallItem,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

logger = logging.getLogger(__name__)

# reasoning.effort -> the thinking budget, as a share of the output room (max_output_tokens, else the context
# length): past it the scheduler forces </think> and the answer follows. "none" asks the template to skip the
# thinking (enable_thinking false) and, for a template that ignores that, closes it after one token.
EFFORT_SHARE = {"minimal": 1 / 8, "low": 1 / 4, "medium": 1 / 2, "high": 3 / 4, "xhigh": 1.0, "max": 1.0}

# the chat pipeline's field names -> the Responses request's (error messages and params)
CHAT_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "response_format": "text.format", "messages": "input", "prompt": "input",
              "thinking_budget": "reasoning.effort", "chat_template_kwargs": "reasoning.effort"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def rename_error(err: APIError, tool_index: list[int]) -> APIError:
    """An error of the chat pipeline, naming the field the Responses client sent instead."""
    message, param = err.message, err.param
    head = message.split(":", 1)[0].split(" ", 1)[0]
    if head in CHAT_NAMES:
        message = CHAT_NAMES[head] + message[len(head):]
    if param in CHAT_NAMES:
        param = CHAT_NAMES[param]
    # tools.<k>.function.parameters: k counts the function tools only, and the flat shape has no "function"
    message = re.sub(r"tools\.(\d+)\.function\.",
                     lambda m: f"tools.{tool_index[int(m.group(1))] if int(m.group(1)) < len(tool_index) else m.group(1)}.",
                     message)
    return APIError(err.status, message, param, err.code, err.headers)


def _field_error(where: str, e: ValidationError, param: str) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return APIError(400, f"{where}.{loc}: {err['msg']}" if loc else f"{where}: {err['msg']}", param, "invalid_type")


def to_tools(raw: list[dict[str, Any]] | None) -> tuple[list[ToolDef] | None, list[int], list[dict[str, Any]]]:
    """(the function tools as chat tools, each one's index in `tools`, the tools echoed in the response)."""
    if not raw:
        return None, [], []
    defs, index, echoed = [], [], []
    for k, tool in enumerate(raw):
        kind = tool.get("type")
        if kind is None:
            raise APIError(400, f"tools.{k}.type: is required", "tools")
        if kind != "function":  # a built-in tool of OpenAI's: nothing here runs it
            logger.warning("/v1/responses: tools.%d has type %r, which this server does not run; skipped", k, kind)
            continue
        try:
            tool_def = FunctionTool.model_validate(tool)
        except ValidationError as e:
            raise _field_error(f"tools.{k}", e, "tools") from None
        defs.append(ToolDef(type="function", function=FunctionDef(
            name=tool_def.name, description=tool_def.description, parameters=tool_def.parameters,
            strict=tool_def.strict)))
        index.append(k)
        echoed.append(tool_def.model_dump(exclude_none=True))
    return defs or None, index, echoed


def to_tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice: type {choice.get('type')!r} is not supported (auto, none, required or "
                       "{\"type\": \"function\", \"name\": ...}: this server runs function tools only)", "tool_choice")
    name = choice.get("name")
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.name: a function name (string) is required", "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=name))


def to_response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema: is required when type is json_schema", "text.format")
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat.model_validate(
        {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}))


def effort_budget(req: ResponsesRequest, context_len: int) -> tuple[int | None, dict[str, Any] | None]:
    """(thinking_budget, chat_template_kwargs) for reasoning.effort; (None, None) when none was given."""
    effort = req.reasoning.effort if req.reasoning else None
    if effort is None:
        return None, None
    if effort == "none":
        return 1, {"enable_thinking": False}
    room = min(req.max_output_tokens or context_len, context_len)  # an absurd max_output_tokens is its own 400
    return max(1, int(room * EFFORT_SHARE[effort])), None


def to_chat_request(req: ResponsesRequest, messages: list[ChatMessage], tools: list[ToolDef] | None, rid: str,
                    context_len: int) -> ChatCompletionRequest:
    budget, template_kwargs = effort_budget(req, context_len)
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=to_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=to_response_format(req), user=req.user,
        rid=rid, stream=bool(req.stream), stream_options=StreamOptions(include_usage=True) if req.stream else None,
        thinking_budget=budget, chat_template_kwargs=template_kwargs)


def to_usage(usage: UsageInfo | None) -> ResponseUsage:
    if usage is None:
        return ResponseUsage()
    details = usage.completion_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0))


def keeps_text(content: str, has_calls: bool) -> bool:
    """Whether an answer's text is a message item: whitespace around function calls is not."""
    return bool(content) and (not has_calls or bool(content.strip()))


def to_output(resp: ChatCompletionResponse) -> tuple[list[OutputItem], str | None]:
    """The chat answer's one choice as output items (reasoning, message, function calls) and its finish reason."""
    choice = resp.choices[0]
    msg = choice.message
    items: list[OutputItem] = []
    if msg.reasoning_content:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=msg.reasoning_content)]))
    calls = msg.tool_calls or []
    if keeps_text(msg.content or "", bool(calls)):
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=msg.content or "")]))
    items.extend(FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.function.name,
                                  arguments=c.function.arguments) for c in calls)
    return items, choice.finish_reason


def finish(resp: ResponseObject, items: list[OutputItem], reason: str | None, usage: ResponseUsage) -> ResponseObject:
    """The response once the generation ended: status, output, output_text and usage."""
    incomplete = reason == "length"
    if incomplete and items:
        items[-1].status = "incomplete"
    resp.status = "incomplete" if incomplete else "completed"
    resp.incomplete_details = IncompleteDetails() if incomplete else None
    resp.output = items
    resp.output_text = "".join(p.text for it in items if isinstance(it, OutputMessage) for p in it.content)
    resp.usage = usage
    resp.completed_at = None if incomplete else int(time.time())  # OpenAI sets it on completed ones only
    return resp
