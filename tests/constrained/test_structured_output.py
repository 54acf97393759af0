"""Constrained decoding through the real Scheduler (exact mode): the 20 schemas of bench/grammar_schemas.py,
greedy and sampled (temperature 1), validate with jsonschema in one batch together with unconstrained
requests, whose tokens stay what they are alone; regex and EBNF; the grammar queue (cache, abort,
compile timeout); speculative drafts and retraction keep constrained output exact."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve.bench.grammar_schemas import PROMPTS, SCHEMAS
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from tests.managers.driver import compare, run

MAX_NEW = 160


def _chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def _schema_params(schema: dict, sampled: bool, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0 if sampled else 0.0, seed=seed if sampled else None,
                          json_schema=json.dumps(schema))


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _assert_valid(tokenizer, res, schema: dict, rid: str) -> None:
    assert res.reason["type"] == "stop", f"{rid}: {res.reason} {_text(tokenizer, res.output_ids)!r}"
    value = json.loads(_text(tokenizer, res.output_ids))
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def sched(make_scheduler):
    return make_scheduler()


def test_twenty_schemas_validate_in_a_batch_with_unconstrained_requests(sched, make_scheduler, tokenizer) -> None:
    prompts: dict[str, list[int]] = {}
    params: dict[str, SamplingParams] = {}
    for i, (schema, text) in enumerate(zip(SCHEMAS, PROMPTS)):
        for sampled in (False, True):
            rid = f"{'s' if sampled else 'g'}{i}"
            prompts[rid] = _chat(tokenizer, text)
            params[rid] = _schema_params(schema, sampled, seed=i)
    free = ["Once upon a time", "The capital of France is", "def fib(n):", "Water boils at", "1, 2, 3,",
            "My favourite food is", "The sun is", "In 1492,"]
    for j, text in enumerate(free):
        prompts[f"u{j}"] = _chat(tokenizer, text)
        params[f"u{j}"] = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    batched = run(sched, prompts, params)
    for i, schema in enumerate(SCHEMAS):
        for kind in "gs":
            _assert_valid(tokenizer, batched[f"{kind}{i}"], schema, f"{kind}{i}")
    # unconstrained neighbours are untouched by the masks; so are a few constrained requests alone
    lone_rids = [f"u{j}" for j in range(len(free))] + ["g10", "s3"]
    alone = {rid: run(sched, {rid: prompts[rid]}, params[rid])[rid] for rid in lone_rids}
    assert compare(alone, {rid: batched[rid] for rid in lone_rids}) <= 1
    assert sched.grammar_queue.backend.stats["compiled"] <= len(SCHEMAS)  # each schema compiled once


def test_regex_and_ebnf(sched, tokenizer) -> None:
    cases = {
        "phone": (r"\(\d{3}\) \d{3}-\d{4}", "My phone number is"),
        "date": (r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "Today's date:"),
        "word": (r"[a-z]{3,8}", "A fruit:"),
    }
    prompts = {rid: _chat(tokenizer, text) for rid, (_, text) in cases.items()}
    params = {rid: SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, regex=rx) for rid, (rx, _) in cases.items()}
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30} "."'
    prompts["ebnf"] = _chat(tokenizer, "Is the sky blue? Answer yes or no and why.")
    params["ebnf"] = SamplingParams(max_new_tokens=60, temperature=0.0, ebnf=grammar)
    out = run(sched, prompts, params)
    for rid, (rx, _) in cases.items():
        assert out[rid].reason["type"] == "stop"
        assert re.fullmatch(rx, _text(tokenizer, out[rid].output_ids)), _text(tokenizer, out[rid].output_ids)
    text = _text(tokenizer, out["ebnf"].output_ids)
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", text), text


def test_the_grammar_end_forces_eos_even_with_ignore_eos(sched, tokenizer) -> None:
    p = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True, regex="(yes|no)")
    res = run(sched, {"r": _chat(tokenizer, "Yes or no?")}, p)["r"]
    assert res.reason["type"] == "stop" and _text(tokenizer, res.output_ids) in ("yes", "no")


def test_speculative_drafts_and_retraction_keep_constrained_output(make_scheduler, sched, tokenizer) -> None:
    """ngram drafts are cut at the first token the grammar rejects, and every verified position is
    masked: greedy output equals plain decoding. A pool small enough to retract gives it too."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string",
              "enum": ["apple", "banana", "cherry"]}, "minItems": 6, "maxItems": 6}}, "required": ["items"]}
    text = " list: apple, banana, cherry, apple, banana, cherry. As JSON: "
    # distinct from their first token: no shared prefix, so the small pool below really is small
    prompts = {f"r{k}": tokenizer.encode(w + text) for k, w in enumerate(["Anna's", "Bob's", "Carl's", "Dora's"])}
    p = SamplingParams(max_new_tokens=80, temperature=0.0, json_schema=json.dumps(schema))
    want = run(sched, prompts, p)
    spec = make_scheduler(speculative_algorithm="ngram")
    got = run(spec, prompts, p)  # with logprobs: they come per verified row
    assert spec.spec_worker.verify_ct > 0
    assert compare(want, got) == 0
    for rid in prompts:
        _assert_valid(tokenizer, got[rid], schema, rid)
    # room for the prompts and a few tokens each, and admission that reserves almost nothing for the
    # outputs: they outgrow the pool and retract (a retracted request keeps its matcher and tokens)
    small = make_scheduler(max_total_tokens=sum(map(len, prompts.values())) + 40, max_running_requests=4,
                           init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    got = run(small, prompts, p)
    assert small.stats["num_retractions"] > 0
    assert compare(want, got) == 0


def test_a_constraint_the_vocabulary_cannot_continue_is_a_400_for_that_request_only(sched, tokenizer) -> None:
    """Found by the OpenAPI fuzz: a regex of private-use characters compiles, its first byte token is
    allowed, and then no token continues it. The request ends with a 400 naming the constraint; a
    request beside it in the batch goes on as if alone; nothing is left in the pool."""
    ids = _chat(tokenizer, "Write anything.")
    stuck = SamplingParams(max_new_tokens=16, temperature=0.0, regex="\U000fe185$9\xa0\U000844b4")
    plain = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    alone = run(sched, {"p": ids}, plain)["p"].output_ids
    assert sched.add_request(TokenizedGenerateReqInput("stuck", ids, stuck)) is None
    assert sched.add_request(TokenizedGenerateReqInput("plain", ids, plain)) is None
    outs: dict = {}
    while sched.has_work() or sched.output_processor.pending:
        for o in sched.step():
            outs.setdefault(o.rid, []).append(o)
    last = outs["stuck"][-1]
    assert last.error_status == 400 and last.error.startswith("regex: the constraint admits no token"), last.error
    assert [t for o in outs["plain"] for t in o.new_token_ids] == alone
    assert outs["plain"][-1].error is None
    sched.tree_cache.reset()
    assert sched.allocator.available_size() == sched.allocator.total_size
    assert sched.stats["num_failed_reqs"] == 0  # not an internal error


def test_grammar_queue_abort_and_compile_timeout(make_scheduler, tokenizer) -> None:
    sched = make_scheduler(grammar_compile_timeout=1e-6)
    ids = _chat(tokenizer, "JSON please")
    big = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i, "maximum": 10 * i + 5}
           for i in range(40)}, "required": [f"k{i}" for i in range(40)]}
    p = SamplingParams(max_new_tokens=8, json_schema=json.dumps(big))
    assert sched.add_request(TokenizedGenerateReqInput("slow", ids, p)) is None
    assert sched.add_request(TokenizedGenerateReqInput("gone", ids, p)) is None
    sched.abort_request("gone")
    outs = {}
    while sched.has_work() or sched.output_processor.pending:
        for o in sched.step():
            outs[o.rid] = o
    assert outs["gone"].finished_reason["type"] == "abort"
    assert outs["slow"].error_status == 400 and "did not compile within" in outs["slow"].error
    assert sched.allocator.available_size() == sched.allocator.total_size
    assert not sched.grammar_queue.reqs


@pytest.mark.parametrize("params, field", [
    ({"json_schema": '{"type": "objec"}'}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"regex": "(ab"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"regex": "a" * 100_001}, "regex"),
    ({"regex": 12}, "regex"),
    ({"json_schema": {"type": "object"}, "min_new_tokens": 2}, "min_new_tokens"),
])
def test_bad_constraints_are_value_errors_naming_the_field(params, field, tokenizer) -> None:
    from radixserve.managers.io_struct import GenerateReqInput
    from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
    from radixserve.server_args import ServerArgs

    limits = RequestLimits.build(ServerArgs(), 2048, 49152, 100_000)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        RequestNormalizer(tokenizer, limits).normalize(GenerateReqInput(text="hi", sampling_params=params))
    off = RequestLimits.build(ServerArgs(grammar_backend="none"), 2048, 49152, 100_000)
    with pytest.raises(ValueError, match="--grammar-backend none"):
        RequestNormalizer(tokenizer, off).normalize(GenerateReqInput(text="hi", sampling_params={"regex": "a"}))
