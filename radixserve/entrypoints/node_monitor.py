"""NodeMonitor: is every rank of the replica alive, on this machine and the others? Names the one that is not.

Each node's launcher process (the HTTP server / Engine on node 0, `radixserve serve --node-rank k` elsewhere)
runs one NodeMonitor thread. What it watches:

    its own ranks     their processes' exit status (waitpid: exact, and immediate when one dies)
    the other nodes   through the TCPStore node 0 hosts at --dist-init-addr (the one the ranks rendezvous at):
                        rs/hb/<node>   a counter every node's monitor increments every HEARTBEAT_INTERVAL_S
                        rs/fail        the first failure any node saw, naming the rank (first writer wins)
                        rs/stop        node 0 is stopping the group normally; rs/left/<node>: that node is done
    a hung rank       the collectives' own timeout (--dist-timeout): the rank whose op timed out exits

Why a long step (a big prefill on CPU) is never mistaken for a dead rank: nothing here waits on a rank or
on a collective. A rank is declared dead only when (1) its process has exited, seen by its own node, or
(2) its node's launcher -- a process doing no model work, whose heartbeat thread a step cannot block --
stopped heartbeating for HEARTBEAT_TIMEOUT_S (a machine down or a network cut), or (3) a collective
waited longer than --dist-timeout (600 s by default, far above any step; an idle server broadcasts every
200 ms, so an idle group never comes near it).

Which rank is named: a rank that exits because a collective found a peer gone exits with
PEER_LOST_EXIT_CODE and is not the cause; a rank killed by a signal or exiting with an error is. When only
peer-lost exits are seen, the monitor waits GRACE_S for the cause to be reported (locally or by another
node through rs/fail) before naming the rank it has.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from datetime import timedelta
from typing import Any

from radixserve.distributed.host_port import parse_host_port
from radixserve.distributed.rank_layout import RankLayout
from radixserve.managers.scheduler_process import DIST_TIMEOUT_EXIT_CODE, PEER_LOST_EXIT_CODE
from radixserve.server_args import ServerArgs

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0  # a node whose launcher is silent this long is gone (machine down, network cut)
GRACE_S = 3.0  # after a peer-lost exit: time for the rank that caused it to be reported
KEY_FAIL, KEY_STOP, KEY_CONFIG = "rs/fail", "rs/stop", "rs/config"
_CONFIG_FIELDS = ("tp_size", "pp_size", "nnodes", "dtype", "context_length", "max_total_tokens",
                  "page_size", "max_running_requests", "speculative_algorithm", "chunked_prefill_size")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 128 + signal.SIGTERM:
        return "was stopped by SIGTERM"
    if code == PEER_LOST_EXIT_CODE:
        return "stopped because a peer rank went away"
    if code == DIST_TIMEOUT_EXIT_CODE:
        return "timed out in a collective after --dist-timeout (a peer rank is hung or unreachable)"
    return f"exited with code {code}"


def open_rendezvous(args: ServerArgs) -> Any:
    """Node 0 hosts the TCPStore at --dist-init-addr (and publishes its parallel settings); any other node
    connects to it within --dist-init-timeout and checks it was started with the same settings.
    ValueError / RuntimeError naming the address when it cannot."""
    import torch.distributed as dist  # lazy: a one-node launch spawns its scheduler before torch is imported

    host, port = parse_host_port(args.dist_init_addr)
    mine = {k: getattr(args, k) for k in _CONFIG_FIELDS}
    if args.node_rank == 0:
        try:
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S))
        except Exception as e:
            # the master also connects to host:port as a client: a host that is not this machine fails here too
            raise RuntimeError(f"cannot host the rendezvous at --dist-init-addr {args.dist_init_addr} (is {host} an "
                               f"address of this machine, and is port {port} free?): {_first_line(e)}") from None
        store.set(KEY_CONFIG, json.dumps(mine))
        return store
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=args.dist_init_timeout))
        store.set_timeout(timedelta(seconds=args.dist_init_timeout))
        theirs = json.loads(store.get(KEY_CONFIG))  # node 0 sets it right after it starts listening
    except Exception as e:
        raise RuntimeError(
            f"node {args.node_rank}: cannot reach node 0 at --dist-init-addr {args.dist_init_addr} within "
            f"--dist-init-timeout {args.dist_init_timeout:g} s ({_first_line(e)}); is node 0 started, and is "
            "that port open between the machines?") from None
    store.set_timeout(timedelta(seconds=HEARTBEAT_TIMEOUT_S))
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: node 0 has {a!r}, this node {b!r}" for k, (a, b) in diff.items())
        why = f"node {args.node_rank} was started with other settings than node 0 ({shown})"
        store.compare_set(KEY_FAIL, "", why)  # node 0 stops too, saying why, instead of waiting for this node
        raise ValueError(why)
    return store


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class NodeMonitor:
    def __init__(self, args: ServerArgs, procs: dict[int, subprocess.Popen], store: Any = None) -> None:
        self.layout = RankLayout(args.tp_size, args.pp_size, args.nnodes)
        self.node = args.node_rank
        self.procs = procs
        self.store = store
        self.join_timeout_s = args.dist_init_timeout
        self.failure: str | None = None  # the first failure, naming the rank (or node)
        self.group_ended = False  # node k: node 0 stopped the group normally
        self._stopping = False
        self._first_exit: float | None = None
        self._started = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last counter value, when it changed)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-node-monitor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._done.wait(HEARTBEAT_INTERVAL_S):
            with self._lock:
                if self._stopping or self.failure is not None or self.group_ended:
                    continue
                try:
                    self._tick()
                except Exception as e:  # the store is gone: node 0's launcher died, or the network broke
                    if self.node == 0:
                        self._fail(f"the rendezvous store failed: {_first_line(e)}", publish=False)
                    else:
                        self._fail(f"node {self.node} lost contact with node 0 ({_first_line(e)}): node 0 "
                                   "stopped or the network between the machines broke", publish=False)

    def _tick(self) -> None:
        local = self._local_failure()
        if self.store is None:
            if local:
                self._fail(local, publish=False)
            return
        self.store.add(f"rs/hb/{self.node}", 1)
        if self.node > 0 and self.store.check([KEY_STOP]):
            self.group_ended = True
            return
        if local:
            self._fail(local)
            return
        if self.store.check([KEY_FAIL]):
            self.failure = self.store.get(KEY_FAIL).decode()
            return
        now = time.monotonic()
        for node in range(self.layout.nnodes):
            if node == self.node:
                continue
            count = self.store.add(f"rs/hb/{node}", 0)
            last = self._beats.get(node)
            if last is None or count != last[0]:
                self._beats[node] = (count, now)
            ranks = self.layout.node_ranks(node)
            if count == 0 and now - self._started > self.join_timeout_s:
                self._fail(f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) did not join within "
                           f"--dist-init-timeout {self.join_timeout_s:g} s: start `radixserve serve ... --nnodes "
                           f"{self.layout.nnodes} --node-rank {node}` there, able to reach --dist-init-addr")
            elif count > 0 and now - self._beats[node][1] > HEARTBEAT_TIMEOUT_S:
                self._fail(f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) sent no heartbeat for "
                           f"{HEARTBEAT_TIMEOUT_S:g} s (its machine is down or the network is cut)")

    def _local_failure(self) -> str | None:
        exited = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
        if not exited:
            return None
        for rank, code in sorted(exited.items()):
            if code not in (0, PEER_LOST_EXIT_CODE):  # the cause, not a rank that only saw it
                return f"{self.layout.describe(rank)} {describe_exit(code)}"
        if self.node > 0 and len(exited) == len(self.procs) and all(c == 0 for c in exited.values()):
            self.group_ended = True  # every rank here got rank 0's ShutdownReq: node 0 stopped the group
            return None
        self._first_exit = self._first_exit or time.monotonic()
        if time.monotonic() - self._first_exit < GRACE_S:
            return None  # let the rank that caused it be reported first (here, or by its node through rs/fail)
        rank, code = min(exited.items())
        return f"{self.layout.describe(rank)} {describe_exit(code)}"

    def _fail(self, why: str, publish: bool = True) -> None:
        if publish and self.store is not None:
            try:  # the first report wins, so every node names the same cause
                why = self.store.compare_set(KEY_FAIL, "", why).decode()
            except Exception:
                pass
        self.failure = why

    # ------------------------------------------------------------------ control
    def report(self, why: str) -> None:
        """A failure the launcher found itself (a rank's start-up error): every node stops, naming it."""
        with self._lock:
            if self.failure is None:
                self._fail(why)

    def stop(self) -> None:
        """Stopping on purpose: node 0 tells the other nodes (rs/stop) before its ranks go, so they end
        quietly; any node marks itself done. Call before stopping the ranks; stops the thread."""
        with self._lock:
            self._stopping = True
            self._done.set()
            if self.store is None:
                return
            try:
                if self.node == 0 and self.failure is None:
                    self.store.set(KEY_STOP, "1")
                self.store.set(f"rs/left/{self.node}", "1")
            except Exception:
                pass  # node 0's store is gone already: nothing to tell

    def wait_for_nodes_to_leave(self, timeout: float) -> None:
        """Node 0: keep hosting the store until the other nodes have read rs/stop (or `timeout`)."""
        if self.store is None or self.node != 0:
            return
        deadline = time.monotonic() + timeout
        others = [f"rs/left/{n}" for n in range(1, self.layout.nnodes)]
        while others and time.monotonic() < deadline:
            try:
                if self.store.check(others):
                    return
            except Exception:
                return
            time.sleep(0.1)
