"""Pipeline parallel over torch.distributed (gloo on this CPU): real scheduler processes, one per rank.

The default model split into 2 stages (15 + 15 layers, embedding on the first, norm + tied LM head on the
last) gives one process's greedy output and logprobs, through every forward mode at once: chunked
prefill (EXTEND chunks), MIXED steps, radix-cache hits, n-gram speculative decoding (TARGET_VERIFY),
retraction under a small pool, and an abort. --check-invariants compares every step's digest across
ranks. A tiny model covers tp 2 x pp 2 (4 ranks). Sizes that do not fit are refused before any process
starts."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

import radixserve
from tests.distributed.conftest import descendants
from tests.managers.driver import Finished, compare, greedy, run

# a repetitive prompt (the n-gram drafts get accepted), a long one (chunks of 32), two sharing a prefix
PROMPTS = [
    "The capital of France is",
    "one two three four one two three four one two three four one two three",
    ("A radix tree is a data structure that stores strings by their shared prefixes, so that looking up a key "
     "walks one edge per distinct piece of it. Explain why a serving engine would use one:"),
    "A radix tree is a data structure that stores strings by their shared prefixes. In short,",
    "List three colours:",
    "Write a haiku about pipelines:",
]
PP_ARGS = {"quantization": "none", "dtype": "float32", "chunked_prefill_size": 32, "enable_mixed_chunk": True,
           "speculative_algorithm": "ngram", "max_total_tokens": 110, "init_new_token_ratio": 0.0,
           "min_new_token_ratio": 0.0}


def test_default_model_at_pp2_matches_one_process(make_scheduler, tokenizer, tmp_path) -> None:
    ids = {f"p{i}": tokenizer.encode(p, add_special_tokens=False) for i, p in enumerate(PROMPTS)}
    want = run(make_scheduler(**PP_ARGS), ids, greedy(16))
    # n-gram drafts are verified for requests without logprobs only
    want_spec = run(make_scheduler(**PP_ARGS), {"r": ids["p1"]}, greedy(24), logprobs=False)["r"].output_ids
    trace = tmp_path / "steps.jsonl"
    before = {p.pid for p in descendants(psutil.Process().pid)}  # other tests' servers are children too
    with radixserve.Engine(pp_size=2, context_length=512, check_invariants=True, show_progress=False,
                           trace_batches=str(trace), **PP_ARGS) as eng:
        rank_pids = {p.pid for p in descendants(psutil.Process().pid)
                     if p.pid not in before and "scheduler_process" in " ".join(p.cmdline())}
        assert len(rank_pids) == 2
        outs = eng.generate(input_ids=list(ids.values()), sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                                           "ignore_eos": True},
                            return_logprob=True, top_logprobs_num=2)
        spec = eng.generate(input_ids=ids["p1"], sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                                  "ignore_eos": True})
        info = eng.get_server_info()
        _abort_one(eng)
        # the server goes on after the abort, and the KV is all back (nothing held by a request)
        again = eng.generate(input_ids=ids["p0"], sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                                   "ignore_eos": True})
        after = eng.get_server_info()
    got = {f"p{i}": Finished(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for i, o in enumerate(outs)}
    excused = compare(want, got)
    assert excused <= 1, excused
    assert again["output_ids"] == outs[0]["output_ids"]
    assert spec["output_ids"] == want_spec
    for rid, ref in want.items():  # first position: the same float32 arithmetic, split over two processes
        a, b = dict(got[rid].top2[0]), dict(ref.top2[0])
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a), (rid, a, b)
    # every path ran: each forward mode, retraction, the radix cache, accepted n-gram drafts
    modes = {json.loads(line)["forward"]["forward_mode"] for line in trace.read_text().splitlines()}
    assert {"PREFILL", "EXTEND", "MIXED", "DECODE", "TARGET_VERIFY"} <= modes, modes
    assert info["num_retractions"] > 0 and info["cache_hit_rate"] > 0, info
    assert info["spec_verify_ct"] > 0 and info["spec_accept_length"] > 1, info
    assert after["num_used_tokens"] == 0 and after["num_running_reqs"] == 0, after
    print(f"pp2: {excused} near-tie divergences excused; {info['num_retractions']} retractions; "
          f"time_split {info['time_split']}")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in rank_pids)


def _abort_one(eng) -> None:
    """A long request aborted while it decodes finishes as aborted; its KV goes back."""
    box = {}

    def go() -> None:
        box["out"] = eng.generate("Count to one thousand:", {"max_new_tokens": 80, "temperature": 0.0,
                                                              "ignore_eos": True}, rid="long")

    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + 60
    while eng.get_server_info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert eng.abort_request("long")
    t.join(60)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort", box
    assert len(box["out"]["output_ids"]) < 80


def test_tp2_x_pp2_tiny_model_matches_one_process(tiny_models, default_model_path) -> None:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    path = tiny_models(4, 2, layers=4, tied=True)  # tied: the last stage's LM head loads the embedding
    ids = {"a": [5, 17, 99, 3, 42], "b": [7, 7, 7], "c": list(range(100, 140))}
    common = {"model_path": path, "tokenizer_path": default_model_path, "max_total_tokens": 512,
              "quantization": "none", "dtype": "float32", "chunked_prefill_size": 16}
    want = run(Scheduler(ServerArgs(**common, check_invariants=True)), ids, greedy(6))
    with radixserve.Engine(tp_size=2, pp_size=2, num_threads=1, check_invariants=True, show_progress=False,
                           **common) as eng:
        outs = eng.generate(input_ids=list(ids.values()), sampling_params={"max_new_tokens": 6, "temperature": 0.0,
                                                                           "ignore_eos": True},
                            return_logprob=True, top_logprobs_num=2)
    got = {rid: Finished(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for rid, o in zip(ids, outs)}
    assert compare(want, got) == 0
    for rid, ref in want.items():
        a, b = dict(got[rid].top2[0]), dict(ref.top2[0])
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a), (rid, a, b)


def test_sizes_that_do_not_fit_are_refused_before_any_process_starts(tiny_models, default_model_path) -> None:
    path = tiny_models(4, 2, layers=2)
    # servers other tests' session fixtures keep running are this process's children too: not counted
    before = {p.pid for p in descendants(psutil.Process().pid)}
    for kw, match in (
        ({"pp_size": 3}, r"pp_size \(3\) is larger than the model's 2 layers"),
        ({"tp_size": 3}, r"attention heads \(4\) is not divisible by tp_size \(3\)"),
        ({"tp_size": 2, "pp_size": 3}, r"pp_size \(3\) is larger"),
    ):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=match):
            radixserve.Engine(model_path=path, tokenizer_path=default_model_path, **kw)
        assert time.monotonic() - t0 < 10
        assert not [p for p in descendants(psutil.Process().pid)
                    if p.pid not in before and "scheduler_process" in " ".join(p.cmdline())]


def test_server_args_bounds() -> None:
    from radixserve.server_args import ServerArgs

    for kw, field in (({"pp_size": 0}, "pp_size"), ({"pp_size": 10**6}, "pp_size"),
                      ({"tp_size": 16, "pp_size": 8}, "pp_size"),
                      ({"pp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:1234"}, "nnodes"),
                      ({"pp_size": 2, "nnodes": 2}, "dist_init_addr"),
                      ({"dist_init_addr": "no-port"}, "dist_init_addr"),
                      ({"dist_init_addr": "host:70000"}, "dist_init_addr"),
                      ({"dist_timeout": 0}, "dist_timeout"), ({"dist_timeout": 1e9}, "dist_timeout"),
                      ({"dist_init_timeout": -1}, "dist_init_timeout"),
                      ({"pp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank")):
        with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
            ServerArgs(**kw)
    ServerArgs(pp_size=2, quantization="int8")  # each stage quantises its own layers
    ServerArgs(tp_size=2, pp_size=2, nnodes=2, dist_init_addr="[::1]:29500")
    with pytest.raises(ValueError, match="ServerArgs.node_rank"):
        radixserve.Engine(pp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")
