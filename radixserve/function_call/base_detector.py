"""BaseDetector: what every tool-call format implements (one file per format, as SGLang splits them).

    feed(delta) -> (content delta, [ToolCallDelta])   plain text goes out as content at once, except a tail
                                                      that could still become a marker; inside a call the
                                                      name goes out as soon as it is complete and the
                                                      arguments in pieces, as OpenAI streams them
    finish()    -> (content delta, [ToolCallDelta])   what was held back; a call the output cut off is dropped
    parse(text) -> (content, [ToolCall])              a whole output: feed + finish, so it always agrees
                                                      with the stream
    calls                                             the complete calls so far
    structural_tag(tools, name, parallel)             the xgrammar structural tag forcing this syntax
    instructions(tools) / render_call(name, args)     the prompt side, for templates without tool support

`tools` (the request's function definitions) is given at creation: a call to a function that is not in
it is dropped (nothing is streamed for it), as SGLang does, and formats whose arguments are not JSON
(qwen3_coder, pythonic) read the parameter types from it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the output (0-based)
    id: str | None = None  # first delta of a call: its id, type and name
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # JSON text
    complete: bool = False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_marker_len(buf: str, markers: list[str]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of a marker (held back from content)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def function_defs(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> the function's parameters schema ({} when it has none), from OpenAI `tools` entries."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def tools_json_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t) for t in tools)


class BaseDetector:
    name = ""  # the --tool-call-parser name

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools
        self.schemas = function_defs(tools)
        self.calls: list[ToolCall] = []
        self._opened = 0  # calls opened so far: a dropped call's index is never reused (a stream saw it)
        self._buf = ""  # text fed and not yet consumed by _step
        self._cur: ToolCall | None = None  # the call being read (None: none, or a call to an unknown function)

    def open_call(self, name: str) -> ToolCall | None:
        """A new call of `name` (None, and nothing to stream, for a function not in tools)."""
        if not self.known(name):
            return None
        call = ToolCall(self._opened, new_call_id(), name)
        self._opened += 1
        self.calls.append(call)
        return call

    def _drop(self) -> None:
        """Forget the call being read unless it is complete (cut off by the length limit, or invalid)."""
        if self._cur is not None and not self._cur.complete:
            self.calls.remove(self._cur)
        self._cur = None

    def known(self, name: str) -> bool:
        """May a call to `name` be returned? Any name when the parser was built without tools."""
        return self.tools is None or name in self.schemas

    # ------------------------------------------------------------------ parsing (per format)
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next piece of output: (its content, the call deltas it completes), as far as it can be decided."""
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what it can of self._buf into `content` / `deltas`; False when it needs more text."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output at once: (content without the calls, complete calls)."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return (content + rest).strip() if self.calls else content + rest, list(self.calls)

    # ------------------------------------------------------------------ enforcing (per format)
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """The structural-tag element for one call of `name` with arguments valid under `schema`."""
        raise NotImplementedError

    separator = "\n"  # between forced calls

    def structural_tag(self, tools: list[dict[str, Any]], required_name: str | None,
                       parallel: bool) -> dict[str, Any]:
        """The xgrammar structural tag that makes the output one call of `required_name`, or (None)
        at least one call of any tool, each call's arguments valid under its function's schema."""
        fns = [t["function"] for t in tools]

        def tag(fn: dict[str, Any]) -> dict[str, Any]:
            return self.call_tag(fn["name"], fn.get("parameters") or {"type": "object"})

        if required_name is not None:
            fmt: dict[str, Any] = tag(next(fn for fn in fns if fn["name"] == required_name))
        else:
            fmt = {"type": "tags_with_separator", "tags": [tag(fn) for fn in fns], "separator": self.separator,
                   "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "structural_tag", "format": fmt}

    # ------------------------------------------------------------------ prompting (per format)
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt block that lists `tools` and teaches this format (generic rendering)."""
        raise NotImplementedError

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """An assistant turn's calls [(name, arguments object)] written in this format (history)."""
        raise NotImplementedError
