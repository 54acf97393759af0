"""qwen3_coder: Qwen3-Coder's XML-style calls (also Qwen3.5 / Qwen3-Coder-Next).

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

VALUE is raw text, one newline on each side stripped (the chat template writes them); it becomes a JSON
value by the type its function's schema gives the parameter, as vLLM's and SGLang's parsers do:
string -> the raw text; integer / number -> int / float; boolean -> true / false; object / array ->
JSON (or a Python literal); "null" -> null. A value that does not convert, or a parameter the schema
does not know, stays a string: the arguments are validated only when a grammar forces the call.

Streaming: the name goes out once `<function=NAME>` is complete, then the arguments one parameter at a
time (`{"a": 1`, `, "b": "x"`, `}`). A `<tool_call>` not followed by `<function=` is content; a call the
output cuts off, or one broken by stray text between parameters, is dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.function_call.base_detector import (
    BaseDetector,
    ToolCallDelta,
    partial_marker_len,
    tools_json_lines,
)
from radixserve.function_call.python_literal import parse_literal

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FN_START, FN_END = "<function=", "</function>"
P_START, P_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_MAX_NAME_CHARS = 128  # a function / parameter name still unclosed after this many characters is not one
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}

INSTRUCTIONS = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n</IMPORTANT>"
)


def param_type(schema: dict[str, Any], param: str) -> str | None:
    prop = (schema.get("properties") or {}).get(param)
    if not isinstance(prop, dict):
        return None
    t = prop.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if t is None and "enum" in prop:
        return "enum" if all(isinstance(v, str) for v in prop["enum"]) else None
    return t if isinstance(t, str) else None


def convert_value(raw: str, typ: str | None) -> Any:
    """A parameter's raw text -> its JSON value, by the schema type (see the module docstring)."""
    value = raw.removeprefix("\n")
    value = value.removesuffix("\n")
    if value.strip().lower() == "null":
        return None
    if typ is None or typ in _STRING_TYPES:  # a parameter the schema does not type stays text (vLLM)
        return value
    s = value.strip()
    try:
        if typ == "integer":
            return int(s)
        if typ == "number":
            f = float(s)
            return int(f) if f.is_integer() and re.fullmatch(r"-?\d+", s) else f
        if typ == "boolean":
            if s.lower() in ("true", "false"):
                return s.lower() == "true"
            return value
    except ValueError:
        return value
    if typ in ("object", "array"):
        try:
            return json.loads(s)
        except ValueError:
            try:
                return parse_literal(s)
            except ValueError:
                return value
    return value


class Qwen3CoderDetector(BaseDetector):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._raw = ""  # `<tool_call>` and what followed it, given back if no `<function=` comes
        self._state = "text"  # text | head | params | value | tail
        self._fn = ""  # the function being read (its call may be skipped: unknown name)
        self._param = ""
        self._nparams = 0
        self._seen = 0  # how much of the current value has been searched for its end

    # ------------------------------------------------------------------ parsing
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.feed("")
        if self._state == "text":
            content += self._buf
        elif self._state == "head":
            content += self._raw + self._buf  # a <tool_call> that never became a call is text
        elif self._state in ("params", "value"):
            self._drop()  # cut off by the length limit
        self._buf, self._raw, self._state = "", "", "text"
        return content, deltas

    def _emit(self, deltas: list[ToolCallDelta], piece: str) -> None:
        if self._cur is not None:
            self._cur.arguments += piece
            deltas.append(ToolCallDelta(self._cur.index, arguments=piece))

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Advance once; False when more text is needed."""
        buf = self._buf
        if self._state == "text":
            pos = buf.find(TOOL_START)
            if pos < 0:
                keep = partial_marker_len(buf, [TOOL_START])
                content.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            content.append(buf[:pos])
            self._raw, self._buf, self._state = TOOL_START, buf[pos + len(TOOL_START) :], "head"
            return True
        if self._state in ("head", "tail"):
            stripped = buf.lstrip()
            if self._state == "head":
                self._raw += buf[: len(buf) - len(stripped)]
            self._buf = buf = stripped
            if self._state == "tail" and buf.startswith(TOOL_END):
                self._buf, self._state = buf[len(TOOL_END) :], "text"
                return True
            if not buf or (self._state == "tail" and TOOL_END.startswith(buf)):
                return False
            if buf.startswith(FN_START):
                end = buf.find(">")
                name = buf[len(FN_START) : end] if end >= 0 else buf[len(FN_START) :]
                if end >= 0 and _NAME.fullmatch(name):
                    self._open(name, deltas)
                    self._buf, self._raw = buf[end + 1 :], ""
                    return True
                if end < 0 and len(name) <= _MAX_NAME_CHARS and _NAME.fullmatch(name or "a"):
                    return False  # the name is still arriving
            elif FN_START.startswith(buf):
                return False
            # not a function after all: give the text back and read on (another <tool_call> may follow)
            content.append(self._raw)
            self._raw, self._state = "", "text"
            return True
        if self._state == "params":
            stripped = buf.lstrip()
            self._buf = buf = stripped
            if buf.startswith(FN_END):
                self._emit(deltas, "}" if self._nparams else "{}")
                if self._cur is not None:
                    self._cur.complete = True
                self._cur, self._buf, self._state = None, buf[len(FN_END) :], "tail"
                return True
            if buf.startswith(P_START):
                end = buf.find(">")
                name = buf[len(P_START) : end] if end >= 0 else buf[len(P_START) :]
                if end >= 0 and _NAME.fullmatch(name):
                    self._param, self._buf, self._state = name, buf[end + 1 :], "value"
                    return True
                if end < 0 and len(name) <= _MAX_NAME_CHARS and _NAME.fullmatch(name or "a"):
                    return False
            elif not buf or P_START.startswith(buf) or FN_END.startswith(buf):
                return False
            self._drop()  # stray text inside the call: it is not a call
            self._state = "text"
            return True
        # value: up to </parameter> (or a </function> that closes it early)
        # the search resumes where the last one stopped (a long value arriving in small deltas)
        ends = [i for i in (buf.find(P_END, self._seen), buf.find(FN_END, self._seen)) if i >= 0]
        if not ends:
            self._seen = max(0, len(buf) - len(P_END))
            return False
        self._seen = 0
        end = min(ends)
        value = convert_value(buf[:end], param_type(self.schemas.get(self._fn, {}), self._param))
        prefix = ", " if self._nparams else "{"
        self._emit(deltas, f"{prefix}{json.dumps(self._param)}: {json.dumps(value, ensure_ascii=False)}")
        self._nparams += 1
        self._buf = buf[end + len(P_END) :] if buf.startswith(P_END, end) else buf[end:]
        self._state = "params"
        return True

    def _open(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._fn, self._nparams, self._state = name, 0, "params"
        self._cur = self.open_call(name)
        if self._cur is not None:
            deltas.append(ToolCallDelta(self._cur.index, self._cur.id, name, ""))

    # ------------------------------------------------------------------ enforcing
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        # xgrammar's qwen_xml style writes <parameter=k>v</parameter> with the schema's types (its own
        # builtin qwen_3_coder tag uses the same begin / end); whitespace runs bounded for small models
        return {"type": "tag", "begin": f"{TOOL_START}\n{FN_START}{name}>\n",
                "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml",
                            "max_whitespace_cnt": 2},
                "end": f"\n{FN_END}\n{TOOL_END}"}

    # ------------------------------------------------------------------ prompting
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=tools_json_lines(tools))

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            params = "".join(f"{P_START}{k}>\n{v if isinstance(v, str) else json.dumps(v)}\n{P_END}\n"
                             for k, v in (args.items() if isinstance(args, dict) else []))
            out.append(f"{TOOL_START}\n{FN_START}{name}>\n{params}{FN_END}\n{TOOL_END}")
        return "\n".join(out)
