"""ThinkingGate on the default model's real tokenizer, with real xgrammar matchers as the inner grammar:
the thinking is free (every token allowed, the inner grammar untouched), the budget forces `</think>`'s
canonical tokens, the answer is the inner grammar's, rollback restores every part of the state, and the
"pending" start allows exactly `<think>` or what the grammar allows. Then the real Scheduler: a greedy
request with a budget and a json_schema thinks N free tokens, closes, and answers valid JSON; the
same with n-gram speculative drafts gives the same tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixserve.constrained.grammar_spec import GrammarSpec
from radixserve.constrained.xgrammar_backend import XGrammarBackend, new_bitmask
from radixserve.parser.reasoning_parser import THINK_END, THINK_START
from radixserve.parser.thinking_gate import PENDING, THINKING, ThinkingGate, gate_for
from radixserve.sampling.sampling_params import SamplingParams
from tests.managers.driver import run

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XGrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id], cache_size=8)


def _inner(backend, schema=SCHEMA):
    return backend.new_grammar(backend.compile_async(GrammarSpec("json_schema", json.dumps(schema))).result())


def _gate(tokenizer, start=THINKING, budget=None, inner=None) -> ThinkingGate:
    g = gate_for(SamplingParams(reasoning_start=start, thinking_budget=budget), tokenizer, VOCAB)
    g.inner = inner
    return g


def _mask(g) -> torch.Tensor:
    m = new_bitmask(1, VOCAB)
    g.fill(m, 0)
    return m[0]


def _allowed(g) -> set[int] | None:
    """The allowed token ids, or None when every token is allowed."""
    m = _mask(g)
    if bool((m == -1).all()):
        return None
    bits = ((m.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB]
    return set(torch.nonzero(bits).flatten().tolist())


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_budget_forces_the_canonical_end_marker_then_the_grammar_answers(tokenizer, backend) -> None:
    n = 5
    inner = _inner(backend)
    g = _gate(tokenizer, budget=n, inner=inner)
    end_ids = _ids(tokenizer, THINK_END)
    assert len(end_ids) >= 2  # not one token in SmolLM2's vocabulary: the forcing walks a sequence
    free = _ids(tokenizer, "hmm } not json at all, surely")[:n]
    for tok in free:  # free text: JSON's grammar would refuse these, the thinking does not
        assert _allowed(g) is None
        assert g.accept(tok)
    for tok in end_ids:
        assert _allowed(g) == {tok}
        assert not g.accept(tok + 1)  # a forced step refuses anything else
        assert g.accept(tok)
    assert g.phase == "answer" and g.reasoning_tokens == n + len(end_ids)
    assert torch.equal(_mask(g), _mask(inner))  # the answer is the grammar's, from its start
    for tok in _ids(tokenizer, '{"a": 12}'):
        assert g.accept(tok)
    assert not g.is_terminated() and g.accept(tokenizer.eos_token_id)  # the grammar ends with the stop token
    assert g.is_terminated() and g.reasoning_tokens == n + len(end_ids)


def test_the_model_closing_the_thinking_itself_in_any_split(tokenizer) -> None:
    text = "two < three </thi nope</think> answer"
    ids = _ids(tokenizer, text)
    g = _gate(tokenizer, budget=10_000)
    closed_at = None
    for k, tok in enumerate(ids):
        assert g.accept(tok)
        if closed_at is None and g.phase == "answer":
            closed_at = k + 1
    assert THINK_END in tokenizer.decode(ids[:closed_at]) and THINK_END not in tokenizer.decode(ids[:closed_at - 1])
    assert g.reasoning_tokens == closed_at
    assert _allowed(g) is None and not g.is_terminated()  # no inner grammar: the answer is free


def test_rollback_restores_phase_forcing_count_and_the_inner_grammar(tokenizer, backend) -> None:
    inner = _inner(backend)
    g = _gate(tokenizer, budget=2, inner=inner)
    end_ids = _ids(tokenizer, THINK_END)
    seq = _ids(tokenizer, "ab cd ef")[:2] + end_ids + _ids(tokenizer, '{"a": ')
    snapshots = []
    for tok in seq:
        snapshots.append((g.phase, g.forced_pos, g.reasoning_tokens, _mask(g).clone()))
        assert g.accept(tok)
    for k in range(len(seq), 0, -1):  # speculative verify rejects drafts one at a time or in blocks
        g.rollback(1)
        phase, forced, count, mask = snapshots[k - 1]
        assert (g.phase, g.forced_pos, g.reasoning_tokens) == (phase, forced, count)
        assert torch.equal(_mask(g), mask)
    for tok in seq:  # and the same tokens are accepted again
        assert g.accept(tok)
    g.rollback(len(seq))
    assert g.phase == THINKING and g.reasoning_tokens == 0 and g.tokens == []


def test_pending_allows_the_opening_marker_or_the_grammar(tokenizer, backend) -> None:
    start_ids = _ids(tokenizer, THINK_START)
    inner = _inner(backend)
    g = _gate(tokenizer, start=PENDING, inner=inner)
    first = _allowed(g)
    json_first = _allowed(inner)
    assert first == json_first | {start_ids[0]} and start_ids[0] not in json_first
    for k, tok in enumerate(start_ids):
        assert _allowed(g) == ({tok} if k else first)  # "<" is no JSON: only the marker goes on
        assert g.accept(tok)
    assert g.phase == THINKING and g.reasoning_tokens == len(start_ids)
    assert _allowed(g) is None
    # answering at once: the first tokens are the grammar's, and nothing was thought
    g = _gate(tokenizer, start=PENDING, inner=_inner(backend))
    for tok in [*_ids(tokenizer, '{"a": 3}'), tokenizer.eos_token_id]:
        assert g.accept(tok)
    assert g.phase == "answer" and g.reasoning_tokens == 0 and g.is_terminated()
    # no inner grammar: any spelling of <think> after whitespace opens the thinking
    g = _gate(tokenizer, start=PENDING)
    for tok in _ids(tokenizer, "\n\n<think> x"):
        assert g.accept(tok)
    assert g.phase == THINKING
    g = _gate(tokenizer, start=PENDING)
    for tok in _ids(tokenizer, "Hello"):
        assert g.accept(tok)
    assert g.phase == "answer" and g.reasoning_tokens == 0


def test_no_gate_without_reasoning_start_and_bad_starts_are_refused(tokenizer) -> None:
    assert gate_for(SamplingParams(), tokenizer, VOCAB) is None
    with pytest.raises(ValueError, match="reasoning_start"):
        SamplingParams(reasoning_start="maybe").verify(VOCAB)
    with pytest.raises(ValueError, match="thinking_budget"):
        SamplingParams(thinking_budget=4).verify(VOCAB)  # nothing to budget without a thinking output


def test_scheduler_thinks_n_tokens_then_answers_valid_json(make_scheduler, tokenizer) -> None:
    n = 12
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Give me a JSON object with a."}],
                                           add_generation_prompt=True, tokenize=False) + THINK_START + "\n"
    params = SamplingParams(temperature=0.0, max_new_tokens=100, reasoning_start=THINKING, thinking_budget=n,
                            json_schema=json.dumps(SCHEMA))
    end_ids = _ids(tokenizer, THINK_END)
    outs = []
    for extra in ({}, {"speculative_algorithm": "ngram"}):  # drafts are checked against the gate's masks
        res = run(make_scheduler(**extra), {"r": _ids(tokenizer, prompt)}, params)["r"]
        out = res.output_ids
        assert out[n:n + len(end_ids)] == end_ids and res.reason["type"] == "stop", res.reason
        thought = tokenizer.decode(out[:n])
        answer = tokenizer.decode(out[n + len(end_ids):], skip_special_tokens=True)
        assert THINK_END not in thought and thought.strip()
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert res.meta["reasoning_tokens"] == n + len(end_ids)
        outs.append(out)
    assert outs[0] == outs[1]  # speculative decoding changes nothing
