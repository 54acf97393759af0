"""ReasoningParser: any split of an output into deltas gives the whole text's split, and a
`<tool_call>` inside the thinking stays reasoning (the tool parser sees only the content)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.function_call.registry import create_detector
from radixserve.parser.reasoning_parser import PromptState, ReasoningParser, prompt_state

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
CASES = [
    ("qwen3", PromptState.NONE, "<think>\nlet me think " + CALL + "\n</think>\n\nThe answer " + CALL),
    ("deepseek-r1", PromptState.OPENED, "thinking " + CALL + " done\n</think>\n\n" + CALL),
    ("deepseek-r1", PromptState.NONE, "<think>a</think>b"),
    ("qwen3", PromptState.OPENED, "x < y </thin not yet</think>ok"),
    ("qwen3", PromptState.NONE, "no thinking here"),
    ("deepseek-r1", PromptState.NONE, "never closed"),
]


def _streamed(name: str, state: PromptState, pieces: list[str]) -> tuple[str | None, str]:
    p, r, c = ReasoningParser(name, state), "", ""
    for piece in pieces:
        d = p.feed(piece)
        r, c = r + d.reasoning, c + d.content
    d = p.finish()
    return (r + d.reasoning) or None, c + d.content


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_gives_the_whole_split(case, cuts) -> None:
    name, state, text = case
    marks = sorted({min(k, len(text)) for k in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in pairwise(marks)]
    assert _streamed(name, state, pieces) == ReasoningParser(name, state).parse(text)


def test_tool_call_inside_the_thinking_is_never_extracted() -> None:
    reasoning, content = ReasoningParser("qwen3").parse(CASES[0][2])
    assert CALL in reasoning
    _, calls = create_detector("hermes").parse(content)
    assert [c.name for c in calls] == ["f"]  # only the one after the thinking


def test_prompt_state() -> None:
    assert prompt_state("<|assistant|>\n<think>\n") is PromptState.OPENED
    assert prompt_state("<think>\n\n</think>\n\n") is PromptState.CLOSED
    assert prompt_state("plain") is PromptState.NONE
    assert ReasoningParser("qwen3", PromptState.CLOSED).parse("<think>x</think>y") == (None, "<think>x</think>y")
