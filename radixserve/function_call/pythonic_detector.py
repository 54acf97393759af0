"""pythonic: Llama 3.2 / Llama 4 (and Gemma 3's Python-style prompt) calls as a Python list.

    [get_weather(city="Paris", days=[1, 2]), add(a=1, b=2)]       optionally in <|python_start|> ... <|python_end|>

Keyword arguments only; each value must be a literal (python_literal.py reads it with `ast`, never eval;
the JSON spellings true / false / null are accepted too). A `[` starts a call list only when a name and
`(` follow it, so `[1, 2]` or `[note]` stay content.

Streaming: the name goes out once `name(` has arrived, then the arguments one keyword at a time
(`{"a": 1`, `, "b": "x"`, `}`), each value checked before it is sent. A call with a positional or
non-literal argument is dropped (the rest of the list is still read), as is one the output cuts off;
text after the list that is not `,` / `]` ends it, and that text is content.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from radixserve.function_call.base_detector import (
    BaseDetector,
    ToolCallDelta,
)
from radixserve.function_call.python_literal import parse_literal

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_NAME = r"[A-Za-z_][\w.]*"
_LIST_HEAD = re.compile(rf"\[\s*({_NAME})\s*\(")
_LIST_HEAD_PARTIAL = re.compile(rf"\[\s*(?:{_NAME}\s*)?")  # fullmatch: the head may still come
_CALL_HEAD = re.compile(rf"\s*({_NAME})\s*\(")
_CALL_HEAD_PARTIAL = re.compile(rf"\s*(?:{_NAME}\s*)?")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)", re.DOTALL)
_MAX_HEAD_CHARS = 256  # a name still unfinished after this many characters is not a call

# Gemma 3's documented prompt and Llama 3.2's zero-shot one use these same words
INSTRUCTIONS = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
    "format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n\n"
    "You SHOULD NOT include any other text in the response if you call a function\n{tools}"
)


def _head(s: str, full: re.Pattern[str], partial: re.Pattern[str]) -> re.Match[str] | bool:
    """The head's match, True if `s` may still become one, False if it cannot."""
    m = full.match(s)
    if m:
        return m
    return len(s) <= _MAX_HEAD_CHARS and partial.fullmatch(s) is not None


class PythonicDetector(BaseDetector):
    name = "pythonic"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | args | after | next | end
        self._bad = False  # the call being read had a bad argument: it is skipped
        self._arg = ""  # the current keyword argument's text so far
        self._keys: set[str] = set()
        self._depth = 0
        self._quote = ""  # the open string's quote: ' " ''' or """
        self._esc = False

    # ------------------------------------------------------------------ parsing
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.feed("")
        if self._state in ("text", "end"):
            content += self._buf
        elif self._state == "args":
            self._drop()  # cut off by the length limit
        self._buf, self._state = "", "text"
        return content, deltas

    def _emit(self, deltas: list[ToolCallDelta], piece: str) -> None:
        if self._cur is not None and not self._bad:
            self._cur.arguments += piece
            deltas.append(ToolCallDelta(self._cur.index, arguments=piece))

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._text(buf, content, deltas)
        if self._state == "args":
            end = self._scan()
            if end is None:
                return False
            self._kwarg(end, deltas)
            return True
        if self._state == "after":
            stripped = buf.lstrip()
            self._buf = stripped
            if not stripped:
                return False
            if stripped[0] == ",":
                self._buf, self._state = stripped[1:], "next"
            elif stripped[0] == "]":
                self._buf, self._state = stripped[1:], "end"
            else:
                self._state = "text"  # the list never closed: what follows is content
            return True
        if self._state == "next":
            m = _head(buf, _CALL_HEAD, _CALL_HEAD_PARTIAL)
            if m is True:
                return False
            if m is False:
                self._state = "text"
                return True
            self._open(m.group(1), deltas)
            self._buf = buf[m.end() :]
            return True
        # end: the list closed; Llama 4's <|python_end|> after it is part of the call
        if buf.startswith(PY_END):
            self._buf, self._state = buf[len(PY_END) :], "text"
            return True
        if buf and PY_END.startswith(buf):
            return False
        self._state = "text"
        return True

    def _text(self, buf: str, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Plain text up to the first `[name(` (or `<|python_start|>[name(`)."""
        i = 0
        while True:
            i = min((p for p in (buf.find("[", i), buf.find("<", i)) if p >= 0), default=-1)
            if i < 0:
                content.append(buf)
                self._buf = ""
                return False
            s = buf[i:]
            if s.startswith("<"):
                if not s.startswith(PY_START):
                    if PY_START.startswith(s):
                        break  # the marker may still be arriving
                    i += 1
                    continue
                s = s[len(PY_START) :].lstrip()
                if not s:
                    break
                skip = len(buf) - len(s)
            else:
                skip = i
            m = _head(s, _LIST_HEAD, _LIST_HEAD_PARTIAL)
            if m is True:
                break  # may still become a call list: hold it back
            if m is False:
                i += 1
                continue
            content.append(buf[:i])
            self._open(m.group(1), deltas)
            self._buf = buf[skip + m.end() :]
            return True
        content.append(buf[:i])
        self._buf = buf[i:]
        return False

    def _open(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._state, self._arg, self._keys, self._bad, self._cur = "args", "", set(), False, None
        self._depth, self._quote, self._esc = 0, "", False
        self._cur = self.open_call(name)
        if self._cur is not None:
            deltas.append(ToolCallDelta(self._cur.index, self._cur.id, name, ""))

    def _scan(self) -> str | None:
        """Move the current argument's text from the buffer up to a top-level `,` or `)` (returned,
        consumed), strings and brackets respected; None when more text is needed."""
        buf, i = self._buf, 0
        while i < len(buf):
            ch = buf[i]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif len(self._quote) == 1 and ch == self._quote:
                    self._quote = ""
                elif len(self._quote) == 3 and ch == self._quote[0]:
                    if len(buf) - i < 3 and self._quote.startswith(buf[i:]):
                        break  # a closing triple quote may be arriving
                    if buf.startswith(self._quote, i):
                        self._quote = ""
                        i += 2
                i += 1
                continue
            if ch in "'\"":
                if len(buf) - i < 3:
                    break  # ' or ''' ? the next characters say
                self._quote = ch * 3 if buf.startswith(ch * 3, i) else ch
                i += len(self._quote)
                continue
            if ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                if self._depth == 0:
                    self._arg += buf[:i]
                    self._buf = buf[i + 1 :]
                    return ch
                self._depth -= 1
            elif ch == "," and self._depth == 0:
                self._arg += buf[:i]
                self._buf = buf[i + 1 :]
                return ch
            i += 1
        self._arg += buf[:i]
        self._buf = buf[i:]
        return None

    def _kwarg(self, end: str, deltas: list[ToolCallDelta]) -> None:
        text, self._arg = self._arg, ""
        if text.strip() or end == ",":
            m = _KWARG.fullmatch(text)
            try:
                if m is None or m.group(1) in self._keys:
                    raise ValueError("a positional or repeated argument")
                value = parse_literal(m.group(2))
                piece = f"{', ' if self._keys else '{'}{json.dumps(m.group(1))}: {json.dumps(value)}"
                self._keys.add(m.group(1))
                self._emit(deltas, piece)
            except ValueError:
                if not self._bad:
                    self._drop()
                self._bad = True
        if end == ",":
            return
        if end == ")":
            self._emit(deltas, "}" if self._keys else "{}")
            if self._cur is not None and not self._bad:
                self._cur.complete = True
            self._state = "after"
        else:  # a stray ] or } at the top level of the call: it is broken
            self._drop()
            self._state = "after"
        self._cur = None

    # ------------------------------------------------------------------ enforcing
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{name}(", "content": _kwargs_format(schema), "end": ")"}

    def structural_tag(self, tools: list[dict[str, Any]], required_name: str | None,
                       parallel: bool) -> dict[str, Any]:
        inner = super().structural_tag(tools, required_name, parallel)["format"]
        if inner["type"] == "tags_with_separator":
            inner["separator"] = ", "
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "["}, inner, {"type": "const_string", "value": "]"}]}}

    # ------------------------------------------------------------------ prompting
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return INSTRUCTIONS.format(tools=json.dumps([t.get("function", t) for t in tools], indent=2))

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        def call(name: str, args: Any) -> str:
            items = args.items() if isinstance(args, dict) else []
            return f"{name}({', '.join(f'{k}={_py(v)}' for k, v in items)})"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"


def _py(v: Any) -> str:
    """A JSON value as a Python literal."""
    if v is True or v is False or v is None:
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_py(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _kwargs_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The structural-tag content for `k1=v1, k2=v2`: each value a JSON value of its property's schema
    (JSON literals are Python literals, and true / false / null are read back too). Required properties
    come first in schema order, then the optional ones, each optional; a function with no required
    property may omit them all, or start from its first optional one. A schema without properties
    takes no arguments."""
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required") or [] if k in props]
    optional = [k for k in props if k not in required]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # so a property's $ref resolves

    def value(key: str) -> dict[str, Any]:
        sub = props[key] if isinstance(props[key], dict) else {}
        return {"type": "json_schema", "json_schema": {**copy.deepcopy(sub), **defs}, "max_whitespace_cnt": 4}

    def kwarg(key: str, first: bool) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": f"{'' if first else ', '}{key}="}, value(key)]}

    keys = required + optional
    if not keys:
        return {"type": "const_string", "value": ""}
    elems = [kwarg(k, i == 0) if k in required or i == 0 else {"type": "optional", "content": kwarg(k, False)}
             for i, k in enumerate(keys)]
    seq: dict[str, Any] = {"type": "sequence", "elements": elems}
    return seq if required else {"type": "optional", "content": seq}
