"""Multi-node on one machine: two `radixserve serve` launches (--nnodes 2 --node-rank 0|1) form one group
and serve over HTTP like one launch; a killed rank, a hung rank, a stopped node end everything, naming the
rank, with no process left behind; a node that cannot reach --dist-init-addr fails naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

import radixserve
from tests.distributed.conftest import assert_all_gone, descendants, wait_until
from tests.managers.driver import Finished, compare, greedy, run
from tests.server_process import ServerProcess, free_port

PROMPTS = {"a": [504, 3575, 282, 4649, 314], "b": [7, 7, 7], "c": list(range(100, 130))}
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _nodes(args: list[str]) -> tuple[ServerProcess, ServerProcess]:
    """Node 1 first (it waits for node 0's rendezvous), then node 0, which serves HTTP."""
    addr = f"127.0.0.1:{free_port()}"
    # --num-threads 1: each launch would otherwise give its rank all of this machine's cores, and the two
    # ranks' idle OpenMP threads would spin against each other (on real machines the default is right)
    common = [*args, "--nnodes", "2", "--dist-init-addr", addr, "--context-length", "512", "--check-invariants",
              "--num-threads", "1"]
    node1 = ServerProcess([*common, "--node-rank", "1"])
    node1.start()
    node0 = ServerProcess([*common, "--node-rank", "0"])
    node0.start()
    try:
        node0.wait_ready()
    except BaseException:
        node0.stop(), node1.stop()
        raise
    return node0, node1


def _ranks(node: ServerProcess) -> list[psutil.Process]:
    return [p for p in descendants(node.proc.pid) if "scheduler_process" in " ".join(p.cmdline())]


def _generate(node0: ServerProcess) -> dict[str, list[int]]:
    outs = {}
    for rid, ids in PROMPTS.items():
        r = httpx.post(node0.base_url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=120)
        assert r.status_code == 200, r.text
        outs[rid] = r.json()["output_ids"]
    return outs


def _one_process(sched) -> dict[str, list[int]]:
    return {rid: f.output_ids for rid, f in run(sched, PROMPTS, greedy(GREEDY["max_new_tokens"])).items()}


def test_pp2_over_two_launches_serves_like_one_and_a_killed_rank_stops_both(fast_runner) -> None:
    """Default settings: low-bit weights, each stage quantising its own layers (one process decodes with the
    native stack, the stages layer by layer: a divergence is excused only at a near-tie)."""
    from radixserve.managers.scheduler import Scheduler

    # one prompt at a time, as _generate sends them: the same step shapes on both sides
    sched = Scheduler(fast_runner.server_args, model_runner=fast_runner)
    want = {rid: run(sched, {rid: ids}, greedy(GREEDY["max_new_tokens"]))[rid] for rid, ids in PROMPTS.items()}
    node0, node1 = _nodes(["--pp-size", "2", "--max-total-tokens", "4096"])
    try:
        everything = descendants(node0.proc.pid) + descendants(node1.proc.pid)
        got = {rid: Finished(ids) for rid, ids in _generate(node0).items()}
        assert compare(want, got) <= 1
        victim = _ranks(node1)
        assert len(victim) == 1 and len(_ranks(node0)) == 1
        t0 = time.monotonic()
        victim[0].kill()  # rank 1: the last pipeline stage, on node 1
        assert node0.proc.wait(30) == 1, node0.log()
        assert node1.proc.wait(30) == 1, node1.log()
        elapsed = time.monotonic() - t0
        for node in (node0, node1):
            assert "rank 1 (node 1, pp stage 1) was killed by SIGKILL" in node.log(), node.log()
        assert elapsed < 30, elapsed
        assert_all_gone(everything)
    finally:
        node0.stop(), node1.stop()


def test_tp2_over_two_launches_serves_and_sigterm_stops_every_rank(tiny_models, default_model_path) -> None:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    path = tiny_models(4, 2)
    args = ["--model-path", path, "--tokenizer-path", default_model_path, "--max-total-tokens", "1024"]
    want = _one_process(Scheduler(ServerArgs(model_path=path, tokenizer_path=default_model_path,
                                             max_total_tokens=1024, quantization="none", dtype="float32")))
    node0, node1 = _nodes(["--tp-size", "2", *args])
    try:
        everything = descendants(node0.proc.pid) + descendants(node1.proc.pid)
        assert len(_ranks(node0)) == len(_ranks(node1)) == 1
        got = _generate(node0)
        assert {r: g[:4] for r, g in got.items()} == {r: w[:4] for r, w in want.items()}  # tp 2 sums in another
        # order than one process: a random tiny model's near-ties may differ later
        node0.proc.send_signal(signal.SIGTERM)
        assert node0.proc.wait(30) == 0, node0.log()
        assert node1.proc.wait(30) == 0, node1.log()
        assert "node 1: stopped" in node1.log()
        assert_all_gone(everything)
    finally:
        node0.stop(), node1.stop()


def test_unreachable_dist_init_addr_fails_in_bounded_time_naming_it(tmp_path) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--nnodes", "2", "--node-rank", "1",
                           "--pp-size", "2", "--dist-init-addr", addr, "--dist-init-timeout", "2"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode != 0
    assert f"cannot reach node 0 at --dist-init-addr {addr}" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_rank_stops_the_engine_naming_it(tiny_models, default_model_path, how) -> None:
    """SIGKILL: the launcher sees the exit at once. SIGSTOP: the rank is alive but hung, so rank 0's next
    collective times out after --dist-timeout (5 s here) and rank 0 exits naming the timeout."""
    path = tiny_models(4, 2)
    # servers other tests' session fixtures keep running are this process's children too: not these ranks
    before = {p.pid for p in descendants(psutil.Process().pid)}
    eng = radixserve.Engine(model_path=path, tokenizer_path=default_model_path, pp_size=2, max_total_tokens=512,
                            dist_timeout=5, show_progress=False)
    try:
        ranks = [p for p in descendants(psutil.Process().pid)
                 if p.pid not in before and "scheduler_process" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        assert eng.generate(input_ids=PROMPTS["b"], sampling_params=GREEDY)["output_ids"]
        victim = next(p for p in ranks if p.pid != eng.handle.handles[0].process.pid)  # rank 1
        os.kill(victim.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        wait_until(lambda: eng.handle.handles[0].failure() is not None, 30, "the failure is seen")
        named = ("rank 1 (pp stage 1) was killed by SIGKILL" if how == "kill" else "rank 0 (pp stage 0) timed out "
                 "in a collective after --dist-timeout (a peer rank is hung or unreachable)")
        assert eng.handle.handles[0].failure() == named
        with pytest.raises(Exception, match="scheduler process died"):
            eng.generate(input_ids=PROMPTS["b"], sampling_params=GREEDY)
    finally:
        eng.shutdown()
    assert_all_gone(ranks)
