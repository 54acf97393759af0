"""ToolCallParser: a model's tool-call syntax -> OpenAI tool calls, incrementally.

One state machine serves every format; a format only names its markers:

    hermes   (Qwen, Hermes, the generic rendering)   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   (Llama 3.x JSON tool calling)           <|python_tag|>{"name": ..., "parameters": {...}}  or the bare JSON
    mistral                                          [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

    feed(delta) -> (content delta, [ToolCallDelta])   plain text goes out as content at once, except a tail
                                                      that could still become a trigger; inside a call the
                                                      name goes out as soon as it is complete and the
                                                      arguments piece by piece, as OpenAI streams them
    finish()    -> (content delta, [ToolCallDelta])   what was held back; a call the output cut off is dropped
    calls                                             the complete calls so far

The same object builds the structural tag (xgrammar) that forces this syntax when tool_choice is
"required" or names a function, so what is enforced is exactly what is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
# a head longer than this that still does not parse is not a tool call
_MAX_HEAD_CHARS = 512


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
    arguments: str = ""  # JSON text, as the model wrote it
    complete: bool = False


@dataclass
class _Format:
    name: str
    triggers: tuple[tuple[str, bool], ...]  # (marker, consumed): a marker not consumed starts the call JSON
    separators: str  # skipped between calls of one section
    section_end: str  # closes a section ("" = the first thing that is not a call)
    args_key: str  # the key the grammar writes
    begin: str  # structural tag: text before the arguments of a call to NAME ({name} is replaced)
    end: str  # ... and after them


FORMATS = {
    "hermes": _Format("hermes", (("<tool_call>", True),), " \n\t", "</tool_call>", "arguments",
                      '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "llama3": _Format("llama3", (("<|python_tag|>", True), ('{"name"', False)), " \n\t;", "", "parameters",
                      '{{"name": "{name}", "parameters": ', "}"),
    "mistral": _Format("mistral", (("[TOOL_CALLS]", True),), " \n\t[,", "]", "arguments",
                       '[TOOL_CALLS] [{{"name": "{name}", "arguments": ', "}]"),
}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    fmt: _Format
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | head | args | tail | after
    _depth: int = 0
    _in_str: bool = False
    _esc: bool = False
    _raw: str = ""  # the current section's text, given back as content if it turns out not to be a call

    @classmethod
    def create(cls, name: str) -> ToolCallParser:
        return cls(FORMATS[name])

    # ------------------------------------------------------------------ parsing
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.feed("")
        if self._state == "text":
            content += self._buf
        elif self._state == "head":
            content += self._raw + self._buf  # a trigger that never became a call is text
        elif self._state in ("args", "tail"):
            self.calls = [c for c in self.calls if c.complete]  # cut off by the length limit
        self._buf, self._raw, self._state = "", "", "text"
        return content, deltas

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output at once: (content without the calls, complete calls)."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return (content + rest).strip() if self.calls else content + rest, list(self.calls)

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Advance once; False when more text is needed."""
        buf, f = self._buf, self.fmt
        if self._state == "text":
            hit = min(((buf.find(m), m, used) for m, used in f.triggers if m in buf), default=None)
            if hit is None:
                keep = _partial_marker_len(buf, [m for m, _ in f.triggers])
                content.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            pos, marker, used = hit
            content.append(buf[:pos])
            start = pos + len(marker) if used else pos
            self._raw = buf[pos:start]
            self._buf, self._state = buf[start:], "head"
            return True
        if self._state == "head":
            stripped = buf.lstrip(f.separators)
            self._raw += buf[: len(buf) - len(stripped)]
            self._buf = buf = stripped
            if not buf:
                return False
            m = _HEAD.match(buf)
            if m is None:
                if buf[0] != "{" or len(buf) > _MAX_HEAD_CHARS or ("}" in buf and '"name"' not in buf):
                    content.append(self._raw + buf)  # not a call after all
                    self._buf, self._raw, self._state = "", "", "text"
                    return False
                return False  # the head is still arriving
            call = ToolCall(len(self.calls), new_call_id(), json.loads(f'"{m.group(1)}"'))
            self.calls.append(call)
            deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))
            self._buf, self._state = buf[m.end() :], "args"
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        if self._state == "args":
            end = self._scan_value(buf)
            piece = buf if end is None else buf[:end]
            call = self.calls[-1]
            if piece:
                call.arguments += piece
                deltas.append(ToolCallDelta(call.index, arguments=piece))
            if end is None:
                self._buf = ""
                return False
            call.complete = True
            self._buf, self._state = buf[end:], "tail"
            return True
        if self._state == "tail":  # the call object's own closing brace
            stripped = buf.lstrip()
            if not stripped:
                self._buf = stripped
                return False
            self._buf = stripped[1:] if stripped[0] == "}" else stripped
            self._state = "after"
            return True
        # after a call: another one in this section, its end, or (no end marker) back to text
        stripped = buf.lstrip(f.separators)
        if not stripped:
            self._buf = stripped
            return False
        if f.section_end and stripped.startswith(f.section_end):
            self._buf, self._state, self._raw = stripped[len(f.section_end) :], "text", ""
            return True
        if f.section_end and f.section_end.startswith(stripped):
            self._buf = stripped
            return False  # the end marker is still arriving
        if stripped[0] == "{":
            self._buf, self._state, self._raw = stripped, "head", ""
            return True
        self._buf, self._state, self._raw = stripped, "text", ""
        return True

    def _scan_value(self, buf: str) -> int | None:
        """Where the arguments' JSON value ends in `buf` (continuing the scan state), or None."""
        for i, ch in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 0:
                        return i + 1  # the arguments were a bare string
                continue
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None

    # ------------------------------------------------------------------ enforcing
    def structural_tag(self, tools: list[dict[str, Any]], required_name: str | None,
                       parallel: bool) -> dict[str, Any]:
        """The xgrammar structural tag that makes the output one call of `required_name`, or (None)
        at least one call of any tool, each call's arguments valid under its function's schema."""
        def tag(fn: dict[str, Any]) -> dict[str, Any]:
            schema = fn.get("parameters") or {"type": "object"}
            # whitespace runs are bounded: a small model may otherwise pad the arguments forever
            return {"type": "tag", "begin": self.fmt.begin.format(name=fn["name"]),
                    "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 16},
                    "end": self.fmt.end}

        fns = [t["function"] for t in tools]
        if required_name is not None:
            fmt: dict[str, Any] = tag(next(fn for fn in fns if fn["name"] == required_name))
        else:
            fmt = {"type": "tags_with_separator", "tags": [tag(fn) for fn in fns], "separator": "\n",
                   "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "structural_tag", "format": fmt}


def _partial_marker_len(buf: str, markers: list[str]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of a marker (held back from content)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def detect_format(chat_template: str | None) -> str:
    """The parser a chat template implies; hermes for templates without tool support (the generic
    rendering in tool_prompt.py writes that format)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("tools" in t and '"parameters"' in t and "<tool_call>" not in t):
        return "llama3"
    return "hermes"
