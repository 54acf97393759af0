"""The chat route's stream chunks -> the Responses API's server-sent events, in OpenAI's documented order:

    response.created, response.in_progress, then per output item
      reasoning:      output_item.added, content_part.added (reasoning_text), reasoning_text.delta ...,
                      reasoning_text.done, content_part.done, output_item.done
      message:        output_item.added, content_part.added (output_text), output_text.delta ...,
                      output_text.done, content_part.done, output_item.done
      function_call:  output_item.added, function_call_arguments.delta ..., function_call_arguments.done,
                      output_item.done
    and response.completed (response.incomplete at max_output_tokens); an error after the headers went out is
    an `error` event and response.failed. Every event carries its sequence_number (0, 1, ...).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.openai_protocol import ChatCompletionChunk, UsageInfo
from radixserve.entrypoints.openai_serving import APIError
from radixserve.entrypoints.responses.protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
)
from radixserve.entrypoints.responses.translate import finish, keeps_text, new_id, to_usage


class ResponseEvents:
    """One streamed response: feed() it the chat chunks in order, then finish() (or fail())."""

    def __init__(self, resp: ResponseObject) -> None:
        self.resp = resp
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None  # the item being written (always the last one)
        self.text = ""  # the open item's text (message, reasoning) or arguments (function call)
        self.blank = ""  # whitespace not yet known to be a message: around function calls it is not
        self.calls: dict[int, FunctionCallItem] = {}  # the chat stream's tool-call index -> its item
        self.reason: str | None = None
        self.usage: UsageInfo | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        snapshot = self.resp.model_dump()
        return [self.event("response.created", response=snapshot), self.event("response.in_progress",
                                                                                response=snapshot)]

    def feed(self, chunk: ChatCompletionChunk) -> list[str]:
        self.usage = chunk.usage or self.usage
        out: list[str] = []
        for choice in chunk.choices:  # n is 1: one choice
            delta = choice.delta
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._content(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.reason = choice.finish_reason or self.reason
        return out

    def finish(self) -> tuple[list[str], ResponseObject]:
        out: list[str] = []
        if self.blank and not self.calls and not isinstance(self.open, OutputMessage):
            out += self._content("", force=True)  # only whitespace came: it is the answer (as non-streamed)
        out += self._close(incomplete=self.reason == "length")
        resp = finish(self.resp, self.items, self.reason, to_usage(self.usage))
        kind = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        return out + [self.event(kind, response=resp.model_dump())], resp

    def fail(self, err: APIError) -> list[str]:
        self.resp.status = "failed"
        self.resp.error = ResponseError(code=err.code or "server_error", message=err.message)
        self.resp.output = self.items
        return [self.event("error", code=err.code, message=err.message, param=err.param),
                self.event("response.failed", response=self.resp.model_dump())]

    # ------------------------------------------------------------------ items
    def _add(self, item: OutputItem) -> list[str]:
        out = self._close()
        self.items.append(item)
        self.open, self.text = item, ""
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=item.model_dump()))
        part = {"reasoning": ReasoningText(text=""), "message": OutputText(text="")}.get(item.type)
        if part is not None:
            out.append(self._part_event("response.content_part.added", part))
        return out

    def _part_event(self, kind: str, part: Any) -> str:
        assert self.open is not None
        return self.event(kind, item_id=self.open.id, output_index=len(self.items) - 1, content_index=0,
                          part=part.model_dump())

    def _delta(self, kind: str, delta: str, **extra: Any) -> str:
        assert self.open is not None
        self.text += delta
        return self.event(kind, item_id=self.open.id, output_index=len(self.items) - 1,
                          **({} if kind.startswith("response.function_call") else {"content_index": 0}),
                          delta=delta, **extra)

    def _close(self, incomplete: bool = False) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        if isinstance(item, ReasoningItem):
            item.content = [ReasoningText(text=self.text)]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            out.append(self._part_event("response.content_part.done", item.content[0]))
        elif isinstance(item, OutputMessage):
            item.content = [OutputText(text=self.text)]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text,
                                  logprobs=[]))
            out.append(self._part_event("response.content_part.done", item.content[0]))
        else:
            item.arguments = self.text
            out.append(self.event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=self.text))
        item.status = "incomplete" if incomplete else "completed"
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item.model_dump()))
        self.open = None
        return out

    def _reasoning(self, text: str) -> list[str]:
        out = [] if isinstance(self.open, ReasoningItem) else self._add(ReasoningItem(id=new_id("rs"),
                                                                                    status="in_progress"))
        return out + [self._delta("response.reasoning_text.delta", text)]

    def _content(self, text: str, force: bool = False) -> list[str]:
        if not isinstance(self.open, OutputMessage):
            if not force and not keeps_text(self.blank + text, True):
                self.blank += text  # whitespace so far: a message only if no call follows
                return []
            text, self.blank = self.blank + text, ""
            out = self._add(OutputMessage(id=new_id("msg"), status="in_progress"))
        else:
            out = []
        return out + [self._delta("response.output_text.delta", text, logprobs=[])]

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = call.get("function") or {}
        if call.get("id") is not None:  # a new call: its id and name come first
            item = FunctionCallItem(id=new_id("fc"), call_id=call["id"], name=fn.get("name") or "", arguments="",
                                    status="in_progress")
            self.calls[call["index"]] = item
            self.blank = ""
            out += self._add(item)
        if fn.get("arguments") and self.open is self.calls.get(call["index"]):
            out.append(self._delta("response.function_call_arguments.delta", fn["arguments"]))
        return out
