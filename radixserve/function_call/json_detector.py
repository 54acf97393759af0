"""JsonDetector: the state machine shared by the formats whose calls are JSON objects
{"name": ..., "arguments" | "parameters": {...}}; a format only names its markers (hermes_detector.py,
llama3_detector.py, mistral_detector.py, gemma3_detector.py):

    hermes   (Qwen, Hermes, the generic rendering)   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   (Llama 3.x JSON tool calling)           <|python_tag|>{"name": ..., "parameters": {...}}  or the bare JSON
    mistral                                          [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    gemma3   (Gemma 3's documented JSON prompt)      {"name": ..., "parameters": {...}}

Inside a call the name goes out once the head `{"name": "...", "arguments": ` has arrived, then the
arguments' JSON text as it comes (scanned for its end, strings and nesting respected). A head that
does not parse within 512 characters, a marker followed by something other than `{`, or a head whose value
does not start an object, array or string, is content. Arguments that end but are not JSON (`[}`) drop
their call, as a call cut off by the length limit is dropped: what `calls` returns is always JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixserve.function_call.base_detector import (
    BaseDetector,
    ToolCallDelta,
    partial_marker_len,
)

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
# what the arguments' value may start with: the scan below finds the end of an object, array or string only
_VALUE_START = '{["'
# a head longer than this that still does not parse is not a tool call
_MAX_HEAD_CHARS = 512


@dataclass(frozen=True)
class JsonFormat:
    triggers: tuple[tuple[str, bool], ...]  # (marker, consumed): a marker not consumed starts the call JSON
    separators: str  # skipped between calls of one section
    section_end: str  # closes a section ("" = the first thing that is not a call)
    args_key: str  # the key the grammar writes
    begin: str  # structural tag: text before the arguments of a call to NAME ({name} is replaced)
    end: str  # ... and after them


class JsonDetector(BaseDetector):
    fmt: JsonFormat

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | head | args | tail | after
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._raw = ""  # the current section's text, given back as content if it turns out not to be a call

    # ------------------------------------------------------------------ parsing
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

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Advance once; False when more text is needed."""
        buf, f = self._buf, self.fmt
        if self._state == "text":
            hit = min(((buf.find(m), m, used) for m, used in f.triggers if m in buf), default=None)
            if hit is None:
                keep = partial_marker_len(buf, [m for m, _ in f.triggers])
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
            if m.end() == len(buf):
                return False  # the value is still arriving
            name = _json_string(m.group(1)) if buf[m.end()] in _VALUE_START else None
            if name is None:  # `"arguments": 5}`, `"arguments"::}`, a name escape JSON lacks (`\\q`): not a call
                content.append(self._raw + buf[: m.end()])  # its head is content; the text after it is read on
                self._buf, self._raw, self._state = buf[m.end() :], "", "text"
                return True
            self._cur = self.open_call(name)
            if self._cur is not None:
                deltas.append(ToolCallDelta(self._cur.index, self._cur.id, name, ""))
            self._buf, self._state = buf[m.end() :], "args"
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        if self._state == "args":
            end = self._scan_value(buf)
            piece = buf if end is None else buf[:end]
            call = self._cur
            if piece and call is not None:
                call.arguments += piece
                deltas.append(ToolCallDelta(call.index, arguments=piece))
            if end is None:
                self._buf = ""
                return False
            if call is not None:
                call.complete = _is_json(call.arguments)
                self._drop()  # brackets that close but do not match (`[}`): not a call to return
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
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        # whitespace runs are bounded: a small model may otherwise pad the arguments forever
        return {"type": "tag", "begin": self.fmt.begin.format(name=name),
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 16},
                "end": self.fmt.end}

    # ------------------------------------------------------------------ prompting
    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(self.fmt.begin.format(name=n) + json.dumps(a) + self.fmt.end for n, a in calls)


def _json_string(body: str) -> str | None:
    """The JSON string literal "body" decoded, or None when an escape in it is not JSON's."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
