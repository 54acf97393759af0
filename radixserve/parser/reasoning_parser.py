"""ReasoningParser: `<think> reasoning </think> answer` -> (reasoning_content, content), whole or
streamed.

One state machine serves both paths: the non-streaming split is `feed(whole text)` + `finish()`, so
streaming a text in any deltas gives exactly the non-streaming split (tests/parser/ check it with
hypothesis). A marker split across deltas (`</thi` + `nk>`) is held in a small buffer until it is
known to be a marker or not.

Where the output starts (`PromptState`):
- OPENED: the chat template wrote `<think>` into the generation prompt (R1 distills, Qwen3 with
  thinking forced), so the first output token is reasoning;
- CLOSED: the prompt ends with a closed, empty thinking (`enable_thinking: false` in Qwen3's
  template), so everything is content;
- NONE: no marker in the prompt; deepseek-r1 treats the output as reasoning until `</think>`
  (R1 sometimes omits the opening tag), qwen3 only when the output opens with `<think>`.

Whitespace around the reasoning and at the start of the answer is dropped (the templates write
`<think>\n` and `</think>\n\n`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"

# name -> whether an output without an opening `<think>` starts in the reasoning (see module doc)
REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "qwen3": False}
REASONING_PARSER_NAMES = (*REASONING_PARSERS, "auto")


class PromptState(enum.Enum):
    NONE = "none"
    OPENED = "opened"
    CLOSED = "closed"


def prompt_state(prompt: str) -> PromptState:
    """Where the rendered prompt leaves the model: inside an opened `<think>`, after a closed one, or neither."""
    start, end = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
    if start < 0 and end < 0:
        return PromptState.NONE
    return PromptState.OPENED if start > end else PromptState.CLOSED


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """`--reasoning-parser auto`: the template's own thinking convention, or None when it has none.

    A template that writes `<think>` itself (into the generation prompt) is R1's convention: the output
    starts inside the reasoning. A template that only knows `enable_thinking` / `</think>` (Qwen3) lets
    the model open the thinking."""
    if not chat_template or THINK_END not in chat_template and THINK_START not in chat_template:
        return None
    if "enable_thinking" in chat_template:
        return "qwen3"
    return "deepseek-r1"


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser a server runs (None = off). An unknown name is a ValueError listing the known ones."""
    if name is None:
        return None
    if name not in REASONING_PARSER_NAMES:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; known: {', '.join(REASONING_PARSER_NAMES)}")
    return detect_reasoning_parser(chat_template) if name == "auto" else name


def starts_in_reasoning(parser: str, state: PromptState) -> bool | None:
    """True: the output starts as reasoning; False: as content; None: only if it opens with `<think>`."""
    if state is PromptState.OPENED:
        return True
    if state is PromptState.CLOSED:
        return False
    return True if REASONING_PARSERS[parser] else None


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _State(enum.Enum):
    START = 0  # not yet known whether the output opens with <think> (qwen3, no marker in the prompt)
    REASONING = 1
    CONTENT = 2


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One output's split. `feed(delta)` returns what is now certain; `finish()` flushes the rest.

    `raw`: the thinking is returned verbatim, markers and whitespace included (separate_reasoning
    false keeps it in the content), but it is still told apart from the answer, so a tool call written
    inside it is never parsed as a call."""

    def __init__(self, parser: str, state: PromptState = PromptState.NONE, raw: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: unknown parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
        start = starts_in_reasoning(parser, state)
        self.state = _State.START if start is None else (_State.REASONING if start else _State.CONTENT)
        # R1 may still write the opening tag itself when the template did not: drop one at the start
        self.may_open = state is not PromptState.OPENED and start is not False
        self.raw = raw
        self.buf = ""  # text not yet emitted: a possible partial marker, or whitespace that may be trimmed
        self.reasoning_started = False  # leading whitespace of the reasoning is dropped
        self.content_started = False  # leading whitespace of the answer is dropped

    def _open(self, out: ReasoningDelta) -> None:
        """buf (after leading whitespace) starts with the opening tag: consume it."""
        cut = len(self.buf) - len(self.buf.lstrip()) + len(THINK_START)
        if self.raw:
            out.reasoning += self.buf[:cut]
        self.buf, self.may_open = self.buf[cut:], False

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.buf += text
        while True:
            if self.state is _State.START:
                head = self.buf.lstrip()
                if head.startswith(THINK_START):
                    self._open(out)
                    self.state = _State.REASONING
                elif head and not THINK_START.startswith(head):
                    self.state = _State.CONTENT  # not a thinking output: all content
                else:
                    return out
            elif self.state is _State.REASONING:
                if self.may_open:
                    head = self.buf.lstrip()
                    if THINK_START.startswith(head):
                        return out  # empty or maybe the opening tag: wait
                    if head.startswith(THINK_START):
                        self._open(out)
                    self.may_open = False
                end = self.buf.find(THINK_END)
                if end >= 0:
                    if self.raw:
                        out.reasoning += self.buf[: end + len(THINK_END)]
                    else:
                        out.reasoning += self._reasoning_text(self.buf[:end], final=True)
                    self.buf, self.state = self.buf[end + len(THINK_END):], _State.CONTENT
                    continue
                keep = _partial_suffix(self.buf, THINK_END)
                ready, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                out.reasoning += ready if self.raw else self._reasoning_text(ready, final=False)
                return out
            else:
                if not self.content_started:
                    self._strip_answer(out)
                    if not self.buf:
                        return out
                    self.content_started = True
                out.content += self.buf
                self.buf = ""
                return out

    def _reasoning_text(self, ready: str, final: bool) -> str:
        """Reasoning text to emit now: leading whitespace dropped; trailing whitespace held back (it
        is dropped if `</think>` follows), unless `final`, where it is dropped."""
        if not self.reasoning_started:
            ready = ready.lstrip()
        if final:
            ready = ready.rstrip()
        else:
            stripped = ready.rstrip()
            self.buf = ready[len(stripped):] + self.buf
            ready = stripped
        if ready:
            self.reasoning_started = True
        return ready

    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back is emitted (a thinking never closed stays reasoning)."""
        out = ReasoningDelta()
        if self.state is _State.START:
            self.state = _State.CONTENT
        if self.state is _State.REASONING:
            if self.raw:
                out.reasoning = self.buf
            else:
                if self.may_open and THINK_START.startswith(self.buf.lstrip()):
                    self.buf = ""
                out.reasoning = self._reasoning_text(self.buf, final=True)
        else:
            if not self.content_started:
                self._strip_answer(out)
            out.content = self.buf
        self.buf = ""
        return out

    def _strip_answer(self, out: ReasoningDelta) -> None:
        """The answer's leading whitespace is dropped; verbatim (raw), it goes with the thinking, so the
        tool parser sees the answer from its first character either way."""
        stripped = self.buf.lstrip()
        if self.raw:
            out.reasoning += self.buf[: len(self.buf) - len(stripped)]
        self.buf = stripped

    def parse(self, text: str) -> tuple[str | None, str]:
        """Non-streaming: (reasoning_content or None when there was none, content)."""
        a, b = self.feed(text), self.finish()
        reasoning = a.reasoning + b.reasoning
        return (reasoning or None), a.content + b.content
