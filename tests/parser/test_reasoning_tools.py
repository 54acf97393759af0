"""The reasoning parser in front of every tool-call format (registry.DETECTORS), as the chat route chains
them: any split of `thinking with calls </think> answer with calls` into random deltas gives the whole
text's reasoning, content and calls; the calls are the answer's only (a call inside the thinking is
never extracted, in every format, whether the thinking is split out or kept verbatim); and the verbatim
split (separate_reasoning false) loses no character."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.function_call.registry import DETECTORS, create_detector
from radixserve.parser.reasoning_parser import PromptState, ReasoningParser
from tests.function_call.test_tool_formats import CASES, TOOLS

# (parser, where the prompt left the model, how the output opens the thinking)
STARTS = [("qwen3", PromptState.NONE, "<think>\n"), ("deepseek-r1", PromptState.OPENED, ""),
          ("deepseek-r1", PromptState.NONE, "<think>"), ("qwen3", PromptState.OPENED, "\n")]


def _text(fmt: str, opener: str, answer_calls: bool) -> str:
    calls = CASES[fmt][0]
    return opener + "I could call: " + calls + "\nbut first </thin more\n</think>\n\n" + (
        calls if answer_calls else "No call needed.")


def _pieces(text: str, cuts: list[int]) -> list[str]:
    marks = sorted({min(k, len(text)) for k in cuts} | {0, len(text)})
    return [text[a:b] for a, b in pairwise(marks)]


def _chain(fmt: str, name: str, state: PromptState, pieces: list[str], raw: bool = False):
    """serving_chat's order: each delta through the reasoning parser, its answer part into the detector."""
    thinker, det = ReasoningParser(name, state, raw=raw), create_detector(fmt, TOOLS)
    reasoning, content, args, names = "", "", {}, {}
    for k, piece in enumerate(pieces + [None]):
        split = thinker.finish() if piece is None else thinker.feed(piece)
        reasoning += split.reasoning
        text, deltas = det.feed(split.content)
        if k == len(pieces):
            more, extra = det.finish()
            text, deltas = text + more, deltas + extra
        content += text
        for d in deltas:
            if d.name is not None:
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    return reasoning, content, [names[i] for i in sorted(names)], [args[i] for i in sorted(args)], det.calls


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(sorted(DETECTORS)), start=st.sampled_from(STARTS), answer_calls=st.booleans(),
       raw=st.booleans(), cuts=st.lists(st.integers(0, 600), max_size=16))
def test_any_split_gives_the_whole_split_and_only_the_answers_calls(fmt, start, answer_calls, raw, cuts) -> None:
    name, state, opener = start
    text = _text(fmt, opener, answer_calls)
    whole = _chain(fmt, name, state, [text], raw)
    streamed = _chain(fmt, name, state, _pieces(text, cuts), raw)
    assert streamed[0] == whole[0]  # the same reasoning
    assert streamed[1].strip() == whole[1].strip()  # the same content (detectors may move whitespace)
    assert streamed[2] == whole[2] and [json.loads(a) for a in streamed[3]] == [
        json.loads(c.arguments) for c in whole[4]]
    reasoning, _, names, _, calls = whole
    assert CASES[fmt][0] in reasoning and "</thin more" in reasoning  # the thinking's calls stay text
    expected = ["get_weather", "add"] if answer_calls else []
    assert names == [c.name for c in calls] == expected  # only the answer's calls, never the thinking's
    if raw:  # kept verbatim: the thinking + the text the detector saw is the whole output
        answer = text[len(reasoning):]
        assert reasoning + answer == text and reasoning.rstrip().endswith("</think>")
        assert answer == answer.lstrip()  # the answer's leading whitespace goes with the thinking
    else:
        assert reasoning == reasoning.strip() and "</think>" not in reasoning and "<think>" not in reasoning


@settings(max_examples=200, deadline=None)
@given(start=st.sampled_from(STARTS), text=st.text(alphabet="<>/thinkab \n", max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_verbatim_split_loses_nothing_on_any_text(start, text, cuts) -> None:
    name, state, _ = start
    p = ReasoningParser(name, state, raw=True)
    got = ""
    for piece in _pieces(text, cuts):
        d = p.feed(piece)
        got += d.reasoning + d.content
    d = p.finish()
    assert got + d.reasoning + d.content == text
    whole = ReasoningParser(name, state).parse(text)
    streamed = ReasoningParser(name, state)
    r = c = ""
    for piece in _pieces(text, cuts):
        d = streamed.feed(piece)
        r, c = r + d.reasoning, c + d.content
    d = streamed.finish()
    assert ((r + d.reasoning) or None, c + d.content) == whole  # and the split one: any text, any split
