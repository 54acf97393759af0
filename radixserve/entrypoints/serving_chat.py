"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> generation.

Tools: `tools` are rendered through the template (function_call/tool_prompt.py), the output is
parsed by the model's tool-call format (function_call/<format>_detector.py) into `message.tool_calls`,
and tool_choice "required" or a named function adds the structural tag that forces that format
with each function's parameter schema, so the arguments always parse and validate.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.constrained.grammar_spec import GrammarSpec
from radixserve.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
    TopLogprob,
)
from radixserve.entrypoints.openai_serving import (
    OPENAI_RENAMES,
    APIError,
    RequestGroup,
    SSEResponse,
    all_logprob_items,
    finish_reason,
    new_logprob_items,
    parse_body,
    sse_objects,
)
from radixserve.entrypoints.serving_base import UNSUPPORTED_CHAT, OpenAIServingBase, ServingRun
from radixserve.function_call.tool_parser import ToolCallDelta, ToolCallParser, create_detector, detect_format
from radixserve.function_call.tool_prompt import render_for_template, template_supports_tools
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.model_loader.chat_template import NO_TEMPLATE
from radixserve.parser.reasoning_request import ChatReasoning


class _Tools:
    """What one request asked of tools: None when it gets none (no tools, or tool_choice none)."""

    def __init__(self, req: ChatCompletionRequest, parser_name: str) -> None:
        self.defs = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else []
        choice = req.tool_choice
        if not self.defs and choice not in (None, "none"):
            raise APIError(400, "tool_choice: requires tools", "tool_choice")
        names = [t["function"]["name"] for t in self.defs]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", "tools")
        for k, t in enumerate(self.defs):
            params = t["function"].get("parameters")
            if params is not None:
                try:
                    GrammarSpec("json_schema", json.dumps(params)).check()
                except ValueError as e:
                    raise APIError(400, f"tools.{k}.function.parameters: {str(e).split(': ', 1)[1]}", "tools") from None
        self.named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if self.named is not None and self.named not in names:
            raise APIError(400, f"tool_choice: function {self.named!r} is not in tools ({', '.join(names)})",
                           "tool_choice")
        self.active = bool(self.defs) and choice != "none"
        self.parallel = req.parallel_tool_calls is not False
        self.parser_name = parser_name
        self.forced = self.active and (choice == "required" or self.named is not None)

    def parser(self) -> ToolCallParser:
        # the request's tools: calls to other names are dropped, and non-JSON formats read the types
        return create_detector(self.parser_name, self.defs)

    def structural_tag(self) -> dict[str, Any] | None:
        return self.parser().structural_tag(self.defs, self.named, self.parallel) if self.forced else None


class OpenAIServingChat(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        run = await self.run(req, request)
        if run.chunks is not None:
            assert run.group is not None
            return SSEResponse(sse_objects(run.chunks), run.group)
        assert run.response is not None
        return JSONResponse(run.response.model_dump())

    def render(self, req: ChatCompletionRequest) -> tuple[str, _Tools, ChatReasoning]:
        """The prompt `req` renders to, with its tools (each parameter schema checked) and reasoning settings:
        what run() generates from, and what a count of the prompt's tokens (Anthropic's count_tokens) counts."""
        tools = _Tools(req, self.tool_parser_name)
        reasoning = ChatReasoning(req, self.server_args, self.tokenizer.chat_template, self.tm.limits.context_len)
        return self.apply_template(req.messages, tools.defs if tools.active else None, reasoning.template_kwargs), \
            tools, reasoning

    def images(self, messages: list[ChatMessage]) -> list[str] | None:
        """The image parts' URLs in prompt order (what the template's placeholders stand for); None: no image."""
        urls = [part_image_url(part, k) for k, m in enumerate(messages) if isinstance(m.content, list)
                for part in m.content if part.get("type") == "image_url"]
        return urls or None

    async def run(self, req: ChatCompletionRequest, request: Request) -> ServingRun:
        """The call `req` asks for (req.stream picks the form); `request` is watched for a client that
        leaves. The API surfaces that translate onto this route call it too (entrypoints/surfaces.py)."""
        lora = self.check_model(req.model)  # a LoRA adapter's name selects it
        self.check_unsupported(req, UNSUPPORTED_CHAT)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        top_k = self.check_top_logprobs(req.top_logprobs, "top_logprobs")
        prompt, tools, reasoning = self.render(req)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
        constraint, renames = self.constraint(req, tools.structural_tag())
        # max_tokens absent: generate until EOS or the context is full (default_max_new_tokens -1).
        subs, _ = await self.normalize(GenerateReqInput(
            text=prompt, rid=rid, image_data=self.images(req.messages),
            sampling_params={**self.sampling_dict(req, max_new), **constraint, **reasoning.sampling(prompt)},
            return_logprob=bool(req.logprobs), top_logprobs_num=top_k, timeout=req.timeout,
            default_max_new_tokens=-1,  # the tokenizer's BOS rule; a template's own BOS is not doubled
            lora_path=lora,
        ), {**OPENAI_RENAMES, **renames})
        n = req.n or 1
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        if req.stream:
            chunks = self._stream(request, req, rid, group, top_k, n, tools, reasoning)
            return ServingRun(chunks=chunks, group=group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        choices = []
        for i, out in enumerate(outs):
            reason, matched = finish_reason(out["meta_info"])
            logprobs = None
            if req.logprobs:
                logprobs = ChatLogprobs(content=self._logprobs(all_logprob_items(out), top_k))
            # the thinking first: a tool call written inside it is never parsed as a call
            thought, kept, text = reasoning.split(out["text"])
            message = ChatResponseMessage(content=kept + text)
            if tools.active:
                content, calls = tools.parser().parse(text)
                calls = calls if tools.parallel else calls[:1]
                if calls:
                    message = ChatResponseMessage(content=(kept + content) or None, tool_calls=[
                        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                        for c in calls])
                    reason = "tool_calls" if reason == "stop" else reason
            message.reasoning_content = message.reasoning = thought
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched))
        resp = ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                      usage=reasoning.add_usage(self.usage(outs, n), outs))
        return ServingRun(response=resp, outs=outs)

    @property
    def tool_parser_name(self) -> str:
        name = self.server_args.tool_call_parser
        return detect_format(self.tokenizer.chat_template) if name == "auto" else name

    def apply_template(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> str:
        """OpenAI messages (and tools) -> prompt text via the tokenizer's own chat template."""
        plain: list[dict[str, Any]] = []
        takes_images = self.tm.mm_processor is not None
        for k, m in enumerate(messages):
            content = template_content(m.content, k, takes_images)
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, f"messages.{k}.tool_call_id: a tool message must name the call it answers",
                               "messages")
            # "developer" is OpenAI's new name for "system"; templates only know the latter.
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": content if content is not None else ""}
            if m.tool_calls:
                d["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
            plain.append(d)
        if not self.tokenizer.chat_template:
            raise APIError(400, NO_TEMPLATE, "messages")
        plain, extra = render_for_template(plain, tools, template_supports_tools(self.tokenizer.chat_template),
                                           create_detector(self.tool_parser_name))
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False,
                                                      **{**(template_kwargs or {}), **extra})
        except Exception as e:  # noqa: BLE001  # a template's own raise_exception(...) is a client error
            raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None

    @staticmethod
    def _tool_deltas(parser: ToolCallParser, text: str, deltas: list[ToolCallDelta],
                     parallel: bool) -> list[dict[str, Any]]:
        """OpenAI stream deltas: content, then tool_calls[index] opened with id / name and filled with
        arguments in pieces. Whitespace between calls is not content."""
        out: list[dict[str, Any]] = []
        if text and not (parser.calls and not text.strip()):
            out.append({"content": text})
        for d in deltas:
            if not parallel and d.index > 0:
                continue
            if d.id is not None:
                call = {"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}}
            else:
                call = {"index": d.index, "function": {"arguments": d.arguments}}
            out.append({"tool_calls": [call]})
        return out

    def _logprobs(self, items: list[tuple[float, int, list[tuple[int, float]]]], top_k: int) -> list[ChatTokenLogprob]:
        content = []
        for logprob, token_id, top in items:
            text = self.token_text(token_id)
            alts = [TopLogprob(token=self.token_text(t), logprob=v, bytes=list(self.token_text(t).encode()))
                    for t, v in top[:top_k]]
            content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                                            top_logprobs=alts))
        return content

    async def _stream(self, request: Request, req: ChatCompletionRequest, rid: str, group: RequestGroup,
                      top_k: int, n: int, tools: _Tools,
                      reasoning: ChatReasoning) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())
        num = len(group.subs)
        finals: list[dict[str, Any]] = [{} for _ in range(num)]
        parsers = [tools.parser() if tools.active else None for _ in range(num)]
        thinkers = [reasoning.parser() for _ in range(num)]

        def chunk(i: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  reason: str | None = None, matched: Any = None) -> ChatCompletionChunk:
            choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice])

        for i in range(num):  # OpenAI opens every choice with the role
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in group.events(request):
            logprobs = None
            if req.logprobs:
                logprobs = ChatLogprobs(content=self._logprobs(new_logprob_items(out), top_k))
            parser = parsers[i]
            # reasoning deltas first; the tool parser sees only the answer
            thought, text = reasoning.feed(thinkers[i], out["delta"], out["finished"])
            if thought is not None:
                yield chunk(i, thought)
            if parser is None:
                if text or (logprobs and logprobs.content):
                    yield chunk(i, {"content": text}, logprobs)
            else:
                text, deltas = parser.feed(text)
                for delta in self._tool_deltas(parser, text, deltas, tools.parallel):
                    yield chunk(i, delta)
            if out["finished"]:
                finals[i] = out
                reason, matched = finish_reason(out["meta_info"])
                if parser is not None:
                    text, deltas = parser.finish()
                    for delta in self._tool_deltas(parser, text, deltas, tools.parallel):
                        yield chunk(i, delta)
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                yield chunk(i, {}, None, reason, matched)
        if req.stream_options and req.stream_options.include_usage:
            usage = reasoning.add_usage(self.usage(finals, n), finals)
            yield ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[], usage=usage)


def template_content(content: str | list[dict[str, Any]] | None, k: int, takes_images: bool) -> Any:
    """A message's content as the chat template reads it. A text model's template takes a string (text parts
    joined); a vision-language model's takes parts ([{"type": "image"}, {"type": "text", "text": ...}], as
    transformers' processors pass them), and writes the model's image placeholder for each image part."""
    if not isinstance(content, list):
        return [{"type": "text", "text": content or ""}] if takes_images else content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and takes_images:
            parts.append({"type": "image"})
        elif kind == "image_url":
            raise APIError(400, f"messages.{k}.content: this model takes no images (image_url parts need a "
                           "vision-language model)", "messages")
        else:
            raise APIError(400, f"messages.{k}.content: parts are text or image_url, got {kind!r}", "messages")
    return parts if takes_images else "".join(p["text"] for p in parts)


def part_image_url(part: dict[str, Any], k: int) -> str:
    """OpenAI's {"type": "image_url", "image_url": {"url": ...}} (or the url as a plain string)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise APIError(400, f"messages.{k}.content: an image_url part needs image_url.url (a data: URI, or a URL or "
                       "file the server allows)", "messages")
    return url
