"""Every ServerArgs field and every sampling parameter changes something observable, or is refused.

Two kinds of proof, and every field must have one (a new field without one fails
`test_every_field_is_accounted_for`):
- OBSERVED: checked here, in-process, on the shared exact-mode model: the knob set one way and the other,
  and what the scheduler, the normaliser or the output shows differs as the knob says.
- EVIDENCE: knobs whose effect needs processes, sockets or a second model (HTTP bounds, tp/pp/dp, nodes,
  speculative decoding) point to the test that shows it; that test must exist and its module must use the
  knob by name or flag.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.debug.invariants import InvariantError
from radixserve.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from tests.managers.driver import greedy, run

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(1000, 1040))  # 40 tokens of the default model's vocabulary

SERVER_EVIDENCE: dict[str, str] = {
    "model_path": "tests/model_loader/test_loader_errors.py",
    "tokenizer_path": "tests/model_loader/test_loader_hf.py",
    "chat_template": "tests/entrypoints/test_http_chat_template.py",
    "served_model_name": "tests/entrypoints/test_http_openai.py",
    "dtype": "tests/model_executor/test_precision.py",
    "kv_cache_dtype": "tests/model_executor/test_precision.py",
    "device": "tests/test_server_args.py",  # cuda cannot run here: only the refusals of bad devices
    "linear_backend": "tests/models/test_architectures.py",
    "quantization": "tests/model_executor/test_quantized_model.py",
    "quant_max_rows": "tests/model_executor/test_quantized_model.py",
    "disable_cpu_graph": "tests/model_executor/test_decode_stack_architectures.py",
    "disable_weight_cache": "tests/model_loader/test_weight_cache.py",
    "enable_deterministic_inference": "tests/model_executor/test_deterministic.py",
    "host": "tests/entrypoints/test_http_hostile.py",
    "port": "tests/entrypoints/test_http_hostile.py",
    "api_key": "tests/entrypoints/test_http_faults.py",
    "allowed_origins": "tests/entrypoints/test_http_faults.py",
    "graceful_shutdown_timeout": "tests/entrypoints/test_http_dashboard.py",
    "max_queued_requests": "tests/entrypoints/test_http_faults.py",
    "max_request_body_bytes": "tests/entrypoints/test_http_faults.py",
    "responses_store_size": "tests/entrypoints/test_http_responses.py",
    "enable_hierarchical_cache": "tests/mem_cache/test_hicache.py",
    "hicache_storage_dir": "tests/mem_cache/test_hicache.py",
    "hicache_size": "tests/mem_cache/test_hicache.py",
    "swa_full_tokens_ratio": "tests/models/test_swa_engine.py",
    # images (a vision-language model)
    "allowed_local_media_path": "tests/entrypoints/test_http_images.py",
    "max_images_per_request": "tests/entrypoints/test_http_images.py",
    "allow_remote_media": "tests/multimodal/test_image_loader.py",
    "max_image_bytes": "tests/multimodal/test_image_loader.py",
    "max_image_pixels": "tests/multimodal/test_image_loader.py",
    "mm_encoder_cache_mb": "tests/models/test_llava_engine.py",
    "mmproj": "tests/models/test_idefics3_engine.py",
    "disable_hybrid_swa_memory": "tests/models/test_swa_engine.py",
    "max_rerank_documents": "tests/entrypoints/test_http_rerank.py",
    "rpc_timeout": "tests/entrypoints/test_http_faults.py",
    "mem_fraction_static": "tests/model_executor/test_memory_budget.py",
    "tp_size": "tests/distributed/test_tensor_parallel.py",
    "ep_size": "tests/distributed/test_moe_parallel.py",
    "pp_size": "tests/distributed/test_pipeline_parallel.py",
    "dp_size": "tests/distributed/test_data_parallel.py",
    "load_balance_method": "tests/distributed/test_data_parallel.py",
    "nnodes": "tests/distributed/test_multinode.py",
    "node_rank": "tests/distributed/test_multinode.py",
    "dist_init_addr": "tests/distributed/test_multinode.py",
    "dist_timeout": "tests/distributed/test_multinode.py",
    "dist_init_timeout": "tests/distributed/test_multinode.py",
    "speculative_algorithm": "tests/managers/test_speculative.py",
    "speculative_draft_model_path": "tests/managers/test_speculative.py",
    "speculative_num_draft_tokens": "tests/managers/test_speculative.py",
    "speculative_ngram_min_match_window": "tests/managers/test_speculative.py",
    "speculative_ngram_max_match_window": "tests/managers/test_speculative.py",
    "grammar_compile_timeout": "tests/constrained/test_structured_output.py",
    # LoRA (docs/lora.md)
    "lora_paths": "tests/lora/test_lora_default_model.py",
    "enable_lora": "tests/lora/test_lora_manager.py",
    "max_lora_rank": "tests/lora/test_lora_http.py",
    "max_loaded_loras": "tests/lora/test_lora_oracle.py",
    "max_loras_per_batch": "tests/lora/test_lora_oracle.py",
    "lora_dir": "tests/lora/test_lora_http.py",
    "tool_call_parser": "tests/test_server_args.py",
    # reasoning (docs/reasoning.md) and embeddings (docs/embeddings.md)
    "reasoning_parser": "tests/entrypoints/test_http_reasoning.py",
    "thinking_budget": "tests/entrypoints/test_http_reasoning.py",
    "is_embedding": "tests/managers/test_embedding_scheduler.py",
    "pooling": "tests/managers/test_embedding_scheduler.py",
    "num_threads": "tests/distributed/test_tensor_parallel.py",
    "log_level": "tests/test_server_args.py",  # validated; applied by each process's logging set-up
    "show_progress": "tests/entrypoints/test_engine.py",
        }

SAMPLING_EVIDENCE: dict[str, str] = {
    "reasoning_start": "tests/parser/test_thinking_gate.py",  # set by the chat route from the template
    "thinking_budget": "tests/parser/test_thinking_gate.py",
    "skip_special_tokens": "tests/managers/test_detokenizer.py",
    "spaces_between_special_tokens": "tests/entrypoints/test_http_errors.py",  # only true: false is refused
    "no_stop_trim": "tests/managers/test_detokenizer.py",
    "json_schema": "tests/constrained/test_structured_output.py",
    "regex": "tests/constrained/test_structured_output.py",
    "ebnf": "tests/constrained/test_structured_output.py",
    "structural_tag": "tests/function_call/test_tool_parser.py",
}


# ----------------------------------------------------------------------------- helpers
def _limits(**args) -> RequestLimits:
    return RequestLimits.build(ServerArgs(**args), context_len=2048, vocab_size=49152, max_total_num_tokens=16384)


def _normalize(tokenizer, limits: RequestLimits, **req) -> list[TokenizedGenerateReqInput]:
    return RequestNormalizer(tokenizer, limits).normalize(GenerateReqInput(**req))[0]


def _steps(sched) -> list[dict]:
    return sched.get_steps(since=-1)["steps"]


def _one(sched, params: SamplingParams, prompt=PROMPT, rid="r", stream=False) -> tuple[list[int], dict, int]:
    """(tokens, finish reason, number of outputs the scheduler sent) of one request run alone."""
    err = sched.add_request(TokenizedGenerateReqInput(rid, list(prompt), params, stream=stream))
    assert err is None, err.error
    ids, reason, outputs, meta = [], None, 0, {}
    while sched.has_work():
        for out in sched.step():
            outputs += 1
            ids.extend(out.new_token_ids)
            if out.finished_reason is not None:
                reason, meta = out.finished_reason, out.meta_info
    return ids, {"reason": reason, **meta}, outputs


# ----------------------------------------------------------------------------- ServerArgs, observed
def check_max_total_tokens(make_scheduler, tokenizer, tmp_path):
    small = make_scheduler(max_total_tokens=4096).get_server_info()["max_total_num_tokens"]
    big = make_scheduler(max_total_tokens=8192).get_server_info()["max_total_num_tokens"]
    assert big - small == 4096 and small <= 4096, (small, big)  # (slot 0 is the pool's padding slot)


def check_cpu_kv_cache_gb(make_scheduler, tokenizer, tmp_path):
    # without max_total_tokens the pool is sized by the cap: twice the GiB, twice the tokens
    small = make_scheduler(max_total_tokens=None, cpu_kv_cache_gb=0.05).get_server_info()["max_total_num_tokens"]
    big = make_scheduler(max_total_tokens=None, cpu_kv_cache_gb=0.1).get_server_info()["max_total_num_tokens"]
    assert 1.9 < big / small < 2.1, (small, big)


def check_page_size(make_scheduler, tokenizer, tmp_path):
    for page in (1, 16):
        sched = make_scheduler(page_size=page)
        _one(sched, greedy(2), rid="a")
        _, meta, _ = _one(sched, greedy(2), rid="b")
        # the tree holds whole pages only: the 40-token prompt is reused up to a page boundary
        assert meta["cached_tokens"] == (39 if page == 1 else 32), (page, meta)


def check_max_running_requests(make_scheduler, tokenizer, tmp_path):
    sched = make_scheduler(max_running_requests=2)
    seen = []
    run(sched, {f"r{i}": PROMPT[i:] for i in range(5)}, greedy(4),
        on_step=lambda s: seen.append(len(sched.running_batch.reqs)))
    assert max(seen) == 2
    assert any(s["schedule"]["wait_reason"] == "max_running_requests" for s in _steps(sched))


def check_chunked_prefill_size(make_scheduler, tokenizer, tmp_path):
    long = list(range(1000, 1100))
    for chunk, parts in ((None, 1), (32, 4)):
        sched = make_scheduler(chunked_prefill_size=chunk, disable_radix_cache=True)
        _one(sched, greedy(1), prompt=long)
        assert sum(1 for s in _steps(sched) if s["forward"]["num_prefill_tokens"]) == parts, chunk


def check_max_prefill_tokens(make_scheduler, tokenizer, tmp_path):
    for budget, first_step_rids in ((16384, 2), (48, 1)):
        sched = make_scheduler(max_prefill_tokens=budget, chunked_prefill_size=None, disable_radix_cache=True)
        run(sched, {"a": PROMPT, "b": PROMPT[::-1]}, greedy(1))
        assert len(_steps(sched)[0]["schedule"]["rids"]) == first_step_rids, budget


def check_schedule_policy(make_scheduler, tokenizer, tmp_path):
    firsts = {}
    for policy in ("fcfs", "lpm"):
        sched = make_scheduler(schedule_policy=policy, max_running_requests=1)
        _one(sched, greedy(1), rid="warm")  # caches PROMPT
        for rid, prompt in (("fresh", list(range(2000, 2040))), ("shares", PROMPT + [5, 6])):
            assert sched.add_request(TokenizedGenerateReqInput(rid, prompt, greedy(1))) is None
        while sched.has_work():
            sched.step()
        firsts[policy] = [s["schedule"]["rids"] for s in _steps(sched)][1]
    assert firsts == {"fcfs": ["fresh"], "lpm": ["shares"]}, firsts


def check_disable_radix_cache(make_scheduler, tokenizer, tmp_path):
    for disabled, cached in ((False, 39), (True, 0)):
        sched = make_scheduler(disable_radix_cache=disabled)
        _one(sched, greedy(2), rid="a")
        assert _one(sched, greedy(2), rid="b")[1]["cached_tokens"] == cached, disabled


def check_enable_mixed_chunk(make_scheduler, tokenizer, tmp_path):
    for mixed in (False, True):
        sched = make_scheduler(enable_mixed_chunk=mixed, disable_radix_cache=True)
        run(sched, {"a": PROMPT, "b": PROMPT[::-1]}, greedy(6), arrive={"b": 3})
        modes = {s["schedule"]["mode"] for s in _steps(sched)}
        assert ("MIXED" in modes) == mixed, modes


def check_init_new_token_ratio(make_scheduler, tokenizer, tmp_path):
    for ratio in (0.7, 0.3):
        sched = make_scheduler(init_new_token_ratio=ratio, min_new_token_ratio=0.1)
        _one(sched, greedy(1))
        assert _steps(sched)[0]["schedule"]["new_token_ratio"] == pytest.approx(ratio)


def _ratios(sched) -> list[float]:
    return [s["schedule"]["new_token_ratio"] for s in _steps(sched)]


def check_new_token_ratio_decay(make_scheduler, tokenizer, tmp_path):
    sched = make_scheduler(init_new_token_ratio=0.7, min_new_token_ratio=0.1, new_token_ratio_decay=0.05)
    _one(sched, greedy(5))
    r = _ratios(sched)
    assert r[2] == pytest.approx(r[1] - 0.05), r


def check_min_new_token_ratio(make_scheduler, tokenizer, tmp_path):
    sched = make_scheduler(init_new_token_ratio=0.7, min_new_token_ratio=0.5, new_token_ratio_decay=0.15)
    _one(sched, greedy(6))
    assert min(_ratios(sched)) == pytest.approx(0.5), _ratios(sched)


def check_stream_interval(make_scheduler, tokenizer, tmp_path):
    counts = {}
    for interval in (1, 4):
        sched = make_scheduler(stream_interval=interval)
        counts[interval] = _one(sched, greedy(16), stream=True)[2]
    assert counts[1] >= 3 * counts[4], counts


def check_random_seed(make_scheduler, tokenizer, tmp_path):
    from radixserve.managers.scheduler_process import seed_sampling

    sampled = SamplingParams(temperature=1.5, max_new_tokens=12, ignore_eos=True)  # no seed of its own

    def draw(seed: int) -> list[int]:
        sched = make_scheduler(random_seed=seed)
        seed_sampling(sched.server_args)  # what the scheduler process does at start
        return _one(sched, sampled)[0]

    a = draw(1)
    assert draw(1) == a and draw(2) != a


def check_check_invariants(make_scheduler, tokenizer, tmp_path):
    for on in (False, True):
        sched = make_scheduler(check_invariants=on)
        assert sched.add_request(TokenizedGenerateReqInput("r", PROMPT, greedy(4))) is None
        sched.step()
        sched.step()
        req = sched.running_batch.reqs[0]
        # point the request's newest token at a slot the free list still holds: that slot has two owners
        stolen = min(sched.allocator.free_slot_set())
        sched.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len - 1] = stolen
        if on:
            with pytest.raises(InvariantError, match="KV accounting|two owners"):
                sched.step()
        else:
            sched.step()  # unchecked: nobody notices


def check_trace_batches(make_scheduler, tokenizer, tmp_path):
    path = tmp_path / "steps.jsonl"
    sched = make_scheduler(trace_batches=str(path))
    _one(sched, greedy(3))
    sched.tracer.close()
    assert len(path.read_text().strip().split("\n")) == len(_steps(sched)) == 3


def check_context_length(make_scheduler, tokenizer, tmp_path):
    sched = make_scheduler(context_length=64)
    assert sched.get_server_info()["context_len"] == 64
    with pytest.raises(ValueError, match="context length"):
        _normalize(tokenizer, sched.limits, input_ids=PROMPT, sampling_params={"max_new_tokens": 25})
    assert _normalize(tokenizer, sched.limits, input_ids=PROMPT, sampling_params={"max_new_tokens": 24})
    assert _normalize(tokenizer, make_scheduler().limits, input_ids=PROMPT, sampling_params={"max_new_tokens": 25})


def check_attention_backend(make_scheduler, tokenizer, tmp_path):
    names = {b: type(make_scheduler(attention_backend=b).model_runner.attn_backend).__name__
             for b in ("torch_native", "cpu_paged")}
    assert names["torch_native"] != names["cpu_paged"], names


def check_request_timeout(make_scheduler, tokenizer, tmp_path):
    lim = _limits(request_timeout=123.0)
    assert _normalize(tokenizer, lim, input_ids=PROMPT)[0].timeout == 123.0
    assert _normalize(tokenizer, _limits(), input_ids=PROMPT)[0].timeout != 123.0


def _bounded(field: str, tight: int, loose: int, words: tuple[str, ...], **req) -> Callable:
    def check(make_scheduler, tokenizer, tmp_path):
        with pytest.raises(ValueError) as e:
            _normalize(tokenizer, _limits(**{field: tight}), **req)
        assert str(e.value).startswith(words), str(e.value)  # the message starts with the field's name
        assert _normalize(tokenizer, _limits(**{field: loose}), **req)
    return check


def check_grammar_backend(make_scheduler, tokenizer, tmp_path):
    req = {"input_ids": PROMPT, "sampling_params": {"regex": "[ab]+"}}
    assert _normalize(tokenizer, _limits(), **req)
    with pytest.raises(ValueError, match="regex|grammar"):
        _normalize(tokenizer, _limits(grammar_backend="none"), **req)


def check_grammar_cache_size(make_scheduler, tokenizer, tmp_path):
    from radixserve.constrained.grammar_spec import GrammarSpec

    sizes = {}
    for size in (1, 8):
        sched = make_scheduler(grammar_cache_size=size)
        backend = sched.grammar_queue.backend
        for pattern in ("a+", "b+", "c+"):
            backend.compile_async(GrammarSpec("regex", pattern)).result(timeout=60)
        sizes[size] = len(backend.cache)
    assert sizes == {1: 1, 8: 3}, sizes


SERVER_OBSERVED: dict[str, Callable] = {
    "max_total_tokens": check_max_total_tokens,
    "cpu_kv_cache_gb": check_cpu_kv_cache_gb,
    "page_size": check_page_size,
    "max_running_requests": check_max_running_requests,
    "chunked_prefill_size": check_chunked_prefill_size,
    "max_prefill_tokens": check_max_prefill_tokens,
    "schedule_policy": check_schedule_policy,
    "disable_radix_cache": check_disable_radix_cache,
    "enable_mixed_chunk": check_enable_mixed_chunk,
    "init_new_token_ratio": check_init_new_token_ratio,
    "new_token_ratio_decay": check_new_token_ratio_decay,
    "min_new_token_ratio": check_min_new_token_ratio,
    "stream_interval": check_stream_interval,
    "random_seed": check_random_seed,
    "check_invariants": check_check_invariants,
    "trace_batches": check_trace_batches,
    "context_length": check_context_length,
    "attention_backend": check_attention_backend,
    "request_timeout": check_request_timeout,
    "grammar_backend": check_grammar_backend,
    "grammar_cache_size": check_grammar_cache_size,
    "max_prompts_per_request": _bounded("max_prompts_per_request", 2, 3, ("text", "prompt", "input_ids"),
                                        input_ids=[PROMPT, PROMPT, PROMPT]),
    "max_n": _bounded("max_n", 2, 3, ("n",), input_ids=PROMPT, sampling_params={"n": 3}),
    "max_top_logprobs": _bounded("max_top_logprobs", 2, 5, ("top_logprobs",), input_ids=PROMPT,
                                 return_logprob=True, top_logprobs_num=5),
    "max_stop_strings": _bounded("max_stop_strings", 1, 2, ("stop",), input_ids=PROMPT,
                                 sampling_params={"stop": ["x", "y"]}),
    "max_stop_string_len": _bounded("max_stop_string_len", 3, 10, ("stop",), input_ids=PROMPT,
                                    sampling_params={"stop": ["abcdef"]}),
    "max_logit_bias": _bounded("max_logit_bias", 1, 2, ("logit_bias",), input_ids=PROMPT,
                               sampling_params={"logit_bias": {"5": 1.0, "6": 1.0}}),
}


# ----------------------------------------------------------------------------- sampling parameters, observed
def _tokens(make_scheduler, **params) -> list[int]:
    p = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True, **params}
    return _one(make_scheduler(), SamplingParams(**p))[0]


def s_max_new_tokens(ms):
    assert len(_tokens(ms, max_new_tokens=3)) == 3 and len(_tokens(ms, max_new_tokens=7)) == 7


def s_min_new_tokens(ms):
    first = _tokens(ms)[0]
    assert len(_tokens(ms, stop_token_ids=[first], ignore_eos=False)) == 1
    assert len(_tokens(ms, stop_token_ids=[first], ignore_eos=False, min_new_tokens=4)) >= 4


def s_temperature(ms):
    assert _tokens(ms, temperature=2.0, seed=3, max_new_tokens=12) != _tokens(ms, max_new_tokens=12)


def _sampled_equals_greedy(ms, **cut):
    hot = {"temperature": 2.0, "seed": 3, "max_new_tokens": 12}
    greedy_ids = _tokens(ms, max_new_tokens=12)
    assert _tokens(ms, **hot) != greedy_ids
    assert _tokens(ms, **hot, **cut) == greedy_ids  # the cut leaves only the top token


def s_top_p(ms):
    _sampled_equals_greedy(ms, top_p=1e-6)


def s_top_k(ms):
    _sampled_equals_greedy(ms, top_k=1)


def s_min_p(ms):
    _sampled_equals_greedy(ms, min_p=1.0)


def _changes_greedy(ms, **penalty):
    assert _tokens(ms, max_new_tokens=24, **penalty) != _tokens(ms, max_new_tokens=24)


def s_frequency_penalty(ms):
    _changes_greedy(ms, frequency_penalty=2.0)


def s_presence_penalty(ms):
    _changes_greedy(ms, presence_penalty=2.0)


def s_repetition_penalty(ms):
    _changes_greedy(ms, repetition_penalty=2.0)


def s_stop(ms):
    sched = ms()
    ids = _one(sched, greedy(8))[0]
    text = sched.tokenizer.decode(ids[2:4])
    assert text.strip(), ids
    _, meta, _ = _one(sched, SamplingParams(temperature=0, max_new_tokens=8, stop=[text]), rid="s")
    assert meta["reason"]["type"] == "stop" and meta["reason"]["matched"] == text


def s_stop_token_ids(ms):
    ids = _tokens(ms)
    assert _tokens(ms, stop_token_ids=[ids[1]], ignore_eos=False)[-1] == ids[1]
    assert len(_tokens(ms, stop_token_ids=[ids[1]], ignore_eos=False)) <= 2


def s_ignore_eos(ms):
    eos = ms().model_config.eos_token_ids
    eos = min(eos) if isinstance(eos, (list, set, tuple, frozenset)) else eos
    force = {"logit_bias": {eos: 100.0}}
    assert len(_tokens(ms, ignore_eos=False, **force)) == 1
    assert len(_tokens(ms, ignore_eos=True, **force)) == 8


def s_logit_bias(ms):
    assert set(_tokens(ms, logit_bias={777: 100.0})) == {777}


def s_seed(ms):
    hot = {"temperature": 1.5, "max_new_tokens": 12}
    assert _tokens(ms, seed=1, **hot) == _tokens(ms, seed=1, **hot) != _tokens(ms, seed=2, **hot)


def s_n(ms):
    sched = ms()
    out = RequestNormalizer(sched.tokenizer, sched.limits).normalize(
        GenerateReqInput(input_ids=PROMPT, sampling_params={"n": 3}))[0]
    assert len(out) == 3 and len({r.rid for r in out}) == 3


SAMPLING_OBSERVED: dict[str, Callable] = {
    "max_new_tokens": s_max_new_tokens, "min_new_tokens": s_min_new_tokens, "temperature": s_temperature,
    "top_p": s_top_p, "top_k": s_top_k, "min_p": s_min_p, "frequency_penalty": s_frequency_penalty,
    "presence_penalty": s_presence_penalty, "repetition_penalty": s_repetition_penalty, "stop": s_stop,
    "stop_token_ids": s_stop_token_ids, "ignore_eos": s_ignore_eos, "logit_bias": s_logit_bias, "seed": s_seed,
    "n": s_n,
}


# ----------------------------------------------------------------------------- the tests
def test_every_field_is_accounted_for():
    server = {f.name for f in dataclasses.fields(ServerArgs)}
    assert server == set(SERVER_OBSERVED) | set(SERVER_EVIDENCE), (
        f"missing: {sorted(server - set(SERVER_OBSERVED) - set(SERVER_EVIDENCE))}; "
        f"stale: {sorted((set(SERVER_OBSERVED) | set(SERVER_EVIDENCE)) - server)}")
    assert not set(SERVER_OBSERVED) & set(SERVER_EVIDENCE)
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    assert sampling == set(SAMPLING_OBSERVED) | set(SAMPLING_EVIDENCE), (
        f"missing: {sorted(sampling - set(SAMPLING_OBSERVED) - set(SAMPLING_EVIDENCE))}; "
        f"stale: {sorted((set(SAMPLING_OBSERVED) | set(SAMPLING_EVIDENCE)) - sampling)}")


EVIDENCE = sorted({**SERVER_EVIDENCE, **SAMPLING_EVIDENCE}.items())


@pytest.mark.parametrize(("field", "path"), EVIDENCE, ids=[f for f, _ in EVIDENCE])
def test_the_evidence_exists_and_uses_the_knob(field: str, path: str):
    source = (ROOT / path).read_text(encoding="utf-8")
    tests = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert tests, f"{path} holds no test"
    flag = "--" + field.replace("_", "-")
    assert field in source or flag in source, f"{path} never uses {field} / {flag}"


@pytest.mark.parametrize("field", sorted(SERVER_OBSERVED))
def test_server_knob_is_observable(field, make_scheduler, tokenizer, tmp_path):
    SERVER_OBSERVED[field](make_scheduler, tokenizer, tmp_path)


@pytest.mark.parametrize("field", sorted(SAMPLING_OBSERVED))
def test_sampling_parameter_is_observable(field, make_scheduler):
    SAMPLING_OBSERVED[field](make_scheduler)
