"""Data parallel (--dp-size N): N real scheduler groups behind the TokenizerManager's router.

- DP=2 on the default model spreads 64 concurrent requests over both replicas and gives exactly the
  tokens one process gives (deterministic mode: batch-invariant, so how the router splits the batch
  cannot change a token);
- aborts and flush_cache reach every replica; get_server_info()["dp"] reports each;
- prefix_aware routing beats round_robin's cache hit rate on a shared-prefix workload (tiny model:
  the hit rate depends on routing, not on the weights);
- TP=2 x DP=2 on a tiny model answers as TP=1 DP=1 does;
- over HTTP: per-replica /get_server_info, /metrics labels, the dashboard stream and each replica's
  radix tree; a replica whose scheduler is killed fails the waiting requests with 503 and the server
  exits with status 1;
- the router's three methods on real sockets, and absurd values refused naming the field.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import threading
import time

import httpx
import psutil
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

import radixserve
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from tests.server_process import ServerProcess

PROMPTS = [f"Question {i}: what is {i} plus {2 * i + 1}? Answer:" for i in range(64)]
GREEDY8 = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp2():
    """DP=2 on the default model, exact and batch-invariant, one thread per replica (as the reference)."""
    with radixserve.Engine(dp_size=2, quantization="none", dtype="float32", enable_deterministic_inference=True, num_threads=1,
                           max_total_tokens=2048, context_length=512, check_invariants=True,
                           show_progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models(4, 2)


def _tiny_engine(path: str, tokenizer: str, **kw) -> radixserve.Engine:
    return radixserve.Engine(model_path=path, tokenizer_path=tokenizer, max_total_tokens=1024, context_length=256,
                             num_threads=1, quantization="none", dtype="float32", check_invariants=True, show_progress=False, **kw)


@pytest.fixture(scope="module")
def tiny_server(tiny, default_model_path):
    """`radixserve serve --dp-size 2 --load-balance-method round_robin` on the tiny model (killed by the last test)."""
    srv = ServerProcess(["--model-path", tiny, "--tokenizer-path", default_model_path, "--dp-size", "2",
                         "--max-total-tokens", "1024", "--context-length", "256", "--num-threads", "1",
                         "--quantization", "none", "--dtype", "float32", "--load-balance-method", "round_robin"])
    yield from srv.running()


@pytest.fixture
def h(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_tp2_pa(tiny, default_model_path):
    """TP=2 x DP=2: four scheduler processes, two torch.distributed groups; prefix_aware routing."""
    with _tiny_engine(tiny, default_model_path, tp_size=2, dp_size=2, load_balance_method="prefix_aware") as eng:
        yield eng


def test_dp2_spreads_64_requests_and_matches_one_process(dp2, make_scheduler, tokenizer) -> None:
    from tests.managers.driver import run

    got = dp2.generate(PROMPTS, sampling_params=GREEDY8)
    info = dp2.get_server_info()
    served = [r["num_served_reqs"] for r in info["dp"]]
    print("DP=2 requests served per replica:", served)
    assert [r["dp_rank"] for r in info["dp"]] == [0, 1] and sum(served) == 64 and min(served) > 0
    assert info["max_total_num_tokens"] == sum(r["max_total_num_tokens"] for r in info["dp"])
    assert info["prompt_tokens"] == sum(r["prompt_tokens"] for r in info["dp"]) >= 64 * 10

    prev = torch.get_num_threads()
    try:  # the reference: one scheduler (what dp_size 1 runs), same mode and thread count, all 64 at once
        sched = make_scheduler(enable_deterministic_inference=True, num_threads=1, max_total_tokens=4096)
        want = run(sched, {str(i): tokenizer.encode(p, add_special_tokens=False) for i, p in enumerate(PROMPTS)},
                   SamplingParams(**GREEDY8), logprobs=False)
    finally:
        torch.set_num_threads(prev)
    assert [o["output_ids"] for o in got] == [want[str(i)].output_ids for i in range(64)]


def _until(cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_abort_and_flush_reach_every_replica(dp2) -> None:
    dp2.generate(PROMPTS[:8], sampling_params=GREEDY8)
    info = dp2.get_server_info()
    assert all(r["num_cached_tokens"] > 0 for r in info["dp"]), info["dp"]
    assert dp2.flush_cache() is True
    info = dp2.get_server_info()
    assert all(r["num_cached_tokens"] == 0 and r.get("prefix_index_tokens", 0) == 0 for r in info["dp"]), info["dp"]

    # two long requests, one per replica (different prompts: shortest queue), aborted by their parent rid
    results: list = []
    long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    t = threading.Thread(target=lambda: results.append(
        dp2.generate(["Count to one thousand:", "Tell me a very long story:"], sampling_params=long, rid="long")))
    t.start()
    _until(lambda: [r["num_running_reqs"] for r in dp2.get_server_info()["dp"]] == [1, 1])
    assert sorted(dp2.abort_request("long")) == ["long-0", "long-1"]
    t.join(60)
    assert not t.is_alive()
    outs = results[0]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert all(len(o["output_ids"]) < 400 for o in outs)
    _until(lambda: all(r["num_running_reqs"] == 0 and r["num_used_tokens"] == 0 and r["num_in_flight_reqs"] == 0
                       for r in dp2.get_server_info()["dp"]), 30)


def _shared_prefix_ids(groups: int, per_group: int, prefix: int, question: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(groups):
        head = [rng.randrange(100, 49000) for _ in range(prefix)]
        prompts += [head + [rng.randrange(100, 49000) for _ in range(question)] for _ in range(per_group)]
    rng.shuffle(prompts)  # the groups interleave, as independent users' requests do
    return prompts


def test_prefix_aware_beats_round_robin_on_shared_prefixes(h, tiny_tp2_pa) -> None:
    """The same shared-prefix workload through the round_robin server (HTTP) and the prefix_aware Engine."""
    prompts = _shared_prefix_ids(groups=8, per_group=4, prefix=96, question=8)
    params = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}

    def over_http() -> list[dict]:
        assert h.post("/generate", json={"input_ids": prompts, "sampling_params": params}).status_code == 200
        return h.get("/get_server_info").json()

    def in_engine() -> list[dict]:
        tiny_tp2_pa.generate(input_ids=prompts, sampling_params=params)
        return tiny_tp2_pa.get_server_info()

    rates = {}
    for method, flush, served_now, workload in (
            ("round_robin", lambda: h.post("/flush_cache").status_code == 200,
             lambda: [r["num_served_reqs"] for r in h.get("/get_server_info").json()["dp"]], over_http),
            ("prefix_aware", tiny_tp2_pa.flush_cache,
             lambda: [r["num_served_reqs"] for r in tiny_tp2_pa.get_server_info()["dp"]], in_engine)):
        assert flush()  # zeroes the hit-rate counters and the router's prefix index
        before = served_now()
        info = workload()
        assert info["load_balance_method"] == method
        served = [r["num_served_reqs"] - b for r, b in zip(info["dp"], before)]
        rates[method] = info["cache_hit_rate"]
        print(f"{method}: cache hit rate {info['cache_hit_rate']:.3f}, per replica "
              f"{[round(r['cache_hit_rate'], 3) for r in info['dp']]}, requests per replica {served}")
        assert sum(served) == len(prompts) and min(served) > 0
    assert rates["prefix_aware"] > rates["round_robin"], rates


def test_tp2_x_dp2_matches_tp1(tiny, default_model_path, tiny_tp2_pa) -> None:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs
    from tests.managers.driver import greedy, run

    ids = [[5, 17, 99, 3, 42], [7, 7, 7], [11, 12, 13, 14], [300, 200, 100]]
    before = [r["num_served_reqs"] for r in tiny_tp2_pa.get_server_info()["dp"]]
    got = tiny_tp2_pa.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                                "ignore_eos": True}, return_logprob=True)
    after = [r["num_served_reqs"] for r in tiny_tp2_pa.get_server_info()["dp"]]
    assert [a - b for a, b in zip(after, before)] == [2, 2]  # short prompts: shortest queue, in turn
    prev = torch.get_num_threads()
    try:  # the reference: one process, TP=1 DP=1
        sched = Scheduler(ServerArgs(model_path=tiny, tokenizer_path=default_model_path, max_total_tokens=1024,
                                     context_length=256, num_threads=1, quantization="none", dtype="float32", check_invariants=True))
        want = run(sched, {str(i): p for i, p in enumerate(ids)}, greedy(4))
    finally:
        torch.set_num_threads(prev)
    for i, out in enumerate(got):
        ref = want[str(i)]
        assert out["output_ids"] == ref.output_ids
        for (lp, _), top in zip(out["meta_info"]["output_token_logprobs"], ref.top2):
            assert abs(lp - top[0][1]) < 1e-3


def test_http_server_reports_each_replica_and_dies_with_one(tiny_server, h) -> None:
    """Runs last among the server's tests: the server is gone afterwards."""
    srv = tiny_server
    before = [r["num_served_reqs"] for r in h.get("/get_server_info").json()["dp"]]
    body = {"input_ids": [[5, 17, 99, 3, 42]] * 4, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert h.post("/generate", json=body).status_code == 200
    info = h.get("/get_server_info").json()
    assert info["dp_size"] == 2 and [r["num_served_reqs"] - b for r, b in zip(info["dp"], before)] == [2, 2]
    cached = {s.labels["dp_rank"]: s.value for f in text_string_to_metric_families(h.get("/metrics").text)
              for s in f.samples if s.name == "radixserve:num_cached_tokens"}
    assert cached.keys() == {"0", "1"} and min(cached.values()) > 0, cached
    for k in (0, 1):
        tree = h.get(f"/debug/radix_tree?dp_rank={k}").json()
        assert tree["dp_rank"] == k and tree["total_tokens"] > 0
    assert h.get("/debug/radix_tree?dp_rank=2").status_code == 400
    config = h.get("/").text
    assert '"dp_size": 2' in config
    with h.stream("GET", "/v1/stream/metrics?interval_ms=250&steps=16") as r:
        snap = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert [r["dp_rank"] for r in snap["server_info"]["dp"]] == [0, 1]
    assert {s["dp_rank"] for s in snap["steps"]} == {0, 1}

    # kill replica 1's scheduler under load: every waiting client gets a 503, the server exits 1
    scheds = sorted((p for p in psutil.Process(srv.proc.pid).children()
                     if "scheduler_process" in " ".join(p.cmdline())), key=lambda p: p.create_time())
    assert len(scheds) == 2
    long = {"text": "Count:", "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(h.post, "/generate", json=long) for _ in range(8)]
        _until(lambda: min(r["num_running_reqs"] for r in h.get("/get_server_info").json()["dp"]) > 0, 60)
        t0 = time.monotonic()
        os.kill(scheds[1].pid, signal.SIGKILL)
        results = [f.result() for f in futs]
        elapsed = time.monotonic() - t0
    codes = [r.status_code for r in results]
    # replica 1's requests were running: 503 (replica 0's may have finished before the watchdog saw it)
    assert set(codes) <= {200, 503} and codes.count(503) >= 4, [r.text[:200] for r in results]
    assert "dp rank 1 died" in next(r for r in results if r.status_code == 503).text
    assert elapsed < 10, elapsed
    assert srv.proc.wait(30) == 1
    assert "scheduler process of dp rank 1 died" in srv.log()
    assert not scheds[0].is_running() or scheds[0].status() == psutil.STATUS_ZOMBIE


def test_router_methods(tmp_path) -> None:
    from radixserve.managers.data_parallel_controller import BALANCE_ABS, DataParallelController

    ctx = zmq.Context()
    addrs = [f"ipc://{tmp_path}/r{k}" for k in range(2)]
    pulls = [ctx.socket(zmq.PULL) for _ in addrs]
    for s, a in zip(pulls, addrs):
        s.bind(a)

    def req(rid: str, ids: list[int]) -> TokenizedGenerateReqInput:
        return TokenizedGenerateReqInput(rid, ids, SamplingParams())

    try:
        rr = DataParallelController(addrs, "round_robin", 1000)
        assert [rr.send_request(req(f"a{i}", [i])) for i in range(4)] == [0, 1, 0, 1]
        assert pulls[1].recv_pyobj().rid == "a1"

        sq = DataParallelController(addrs, "shortest_queue", 1000)
        assert [sq.send_request(req(f"b{i}", [i])) for i in range(3)] == [0, 1, 0]
        sq.on_finished("b0"), sq.on_finished("b2")
        assert sq.send_request(req("b3", [3])) == 0 and sq.replica_stats(0)["num_served_reqs"] == 2
        sq.send_abort("b1")  # to the replica holding it
        sq.send_abort("b0")  # finished: nowhere

        pa = DataParallelController(addrs, "prefix_aware", 1000)
        a, b = list(range(100, 200)), list(range(300, 400))
        assert pa.send_request(req("c0", a + [1])) == 0 and pa.send_request(req("c1", b + [1])) == 1
        assert pa.send_request(req("c2", a + [2])) == 0  # longest prefix match, though replica 0 is as loaded
        assert pa.send_request(req("c3", b + [2])) == 1
        assert pa.send_request(req("c4", a[:20])) == 0  # too short a match: shortest queue (tie: rotation)
        for i in range(BALANCE_ABS + 2):  # replica 0 overloaded: cache affinity gives way
            pa.send_request(req(f"d{i}", a + [10 + i]))
        assert pa.in_flight[0] - pa.in_flight[1] <= BALANCE_ABS + 1
        small = DataParallelController(addrs, "prefix_aware", 150)  # the index holds no more than a pool
        for i in range(10):
            small.send_request(req(f"e{i}", list(range(i * 1000, i * 1000 + 60))))
        assert all(idx.size <= 150 for idx in small.indexes)
        for c in (rr, sq, pa, small):
            c.close()
    finally:
        for s in pulls:
            s.close(linger=0)
        ctx.term()


def test_absurd_values_are_refused_before_anything_starts() -> None:
    from radixserve.server_args import ServerArgs

    for kw, field in (({"dp_size": 0}, "dp_size"), ({"dp_size": 10**6}, "dp_size"),
                      ({"dp_size": 64, "tp_size": 8}, "dp_size"), ({"load_balance_method": "random"},
                                                                   "load_balance_method"),
                      ({"dp_size": 2, "device": "cuda:1"}, "device"), ({"dp_size": 2, "nnodes": 2}, "dp_size")):
        with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
            ServerArgs(**kw)
    with pytest.raises(ValueError, match="ServerArgs.dp_size"):
        radixserve.Engine(dp_size=10**6)


def test_bench_dp_picks_the_best_hit_rate_among_the_fast_methods() -> None:
    from radixserve.bench.data_parallel import pick_default

    def row(method: str, workload: str, tput: float, hit: float) -> dict:
        return {"method": method, "workload": workload, "total_tok_s": tput, "hit_rate": hit}

    rows = [row("round_robin", "shared-prefix", 100, 0.4), row("round_robin", "random", 100, 0.0),
            row("prefix_aware", "shared-prefix", 120, 0.7), row("prefix_aware", "random", 97, 0.0),
            row("shortest_queue", "shared-prefix", 99, 0.4), row("shortest_queue", "random", 80, 0.0),
            row("dp1", "shared-prefix", 500, 0.9), row("dp1", "random", 500, 0.0)]  # the baseline never wins
    assert pick_default(rows)[0] == "prefix_aware"
    rows[0] = row("round_robin", "shared-prefix", 118, 0.4)
    rows[3] = row("prefix_aware", "random", 90, 0.0)  # 10% slower on random: no longer "as fast"
    assert pick_default(rows)[0] == "round_robin"
