"""DataParallelController: sends each tokenized request to one data-parallel replica (--dp-size N).

    TokenizerManager --send_request(req)--> controller --PUSH--> replica k's rank 0  (to_scheduler of k)
    replica 0..N-1's rank 0 --PUSH--> the TokenizerManager's one PULL socket        (from_scheduler)
                                          \\-- on_finished(rid): k's in-flight count goes down

--load-balance-method:
    round_robin     replicas in turn
    shortest_queue  the replica with the fewest requests in flight, as this router counts them: sent to
                    it and not yet finished (ties: the one after the last pick, so equal loads rotate)
    prefix_aware    each replica's PrefixIndex (a bounded radix tree of the prompts sent to it) says how
                    many leading tokens of this prompt it has seen; the longest match of at least
                    PREFIX_MIN_MATCH_TOKENS and PREFIX_MIN_MATCH_RATIO of the prompt wins (ties: the
                    shorter queue), unless that replica is overloaded (BALANCE_*); else shortest_queue

Where it lives: in the TokenizerManager's process, an object in front of the replicas' sockets -- not a
process of its own as SGLang's DataParallelController is. (1) No extra hop: a router process would
unpickle and re-pickle every request and abort on its way. (2) shortest_queue needs to know when a
request finishes; here every final output passes by on its way to its caller, so the counts are exact
with no feedback channel from the schedulers. (3) One process fewer to watch: a dead router could not
strand requests. Its cost is a dict update per request, plus for prefix_aware one radix-tree walk of
the prompt per replica (`radixserve bench dp` prints the measured time per route; microseconds against
the milliseconds of tokenising and detokenising in the same process). SGLang moves routing out because
its front end is the bottleneck at thousands of requests/s over 8 GPUs; if ours ever is, the same object
can move behind a socket.

Control calls (flush_cache, get_server_info, radix tree, shutdown) go to every replica (broadcast);
an abort goes to the replica that holds the request.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from radixserve.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.managers.prefix_index import PrefixIndex

# A match shorter than this says little: every chat prompt shares its template's few header tokens.
PREFIX_MIN_MATCH_TOKENS = 32
PREFIX_MIN_MATCH_RATIO = 0.5  # ... and at least this share of the prompt (SGLang's router: cache_threshold 0.5)
# Cache affinity must not pile everything on one replica: when the matched replica has more than
# BALANCE_ABS requests in flight beyond the least loaded one, and more than BALANCE_REL times its load,
# the request goes to the shortest queue instead (SGLang's router balances on the same two thresholds).
BALANCE_ABS = 8
BALANCE_REL = 1.5
MAX_INDEX_TOKENS = 1 << 20  # per replica, whatever its KV pool (~40 MiB of Python ints at most)


class DataParallelController:
    def __init__(self, addresses: list[str], method: str, pool_tokens: int) -> None:
        """addresses: each replica's to_scheduler; pool_tokens: a replica's KV pool size (its index holds no more)."""
        self.method = method
        self.size = len(addresses)
        self.ctx = zmq.Context(1)
        self.socks = []
        for addr in addresses:
            # NOTE: plain blocking-API sockets with no send high-water mark: a send queues at once and never
            # awaits, so a request cannot be cancelled half-way between being registered and being sent.
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            self.socks.append(sock)
        self.in_flight = [0] * self.size  # sent, not finished
        self.routed = [0] * self.size
        self.served = [0] * self.size  # finished: completed, aborted or failed
        self.owner: dict[str, int] = {}  # rid -> replica, while in flight
        self._next = 0  # round_robin's turn; shortest_queue's tie-break
        self.route_s = 0.0  # time spent picking replicas (bench dp prints it per request)
        capacity = max(1, min(pool_tokens, MAX_INDEX_TOKENS))
        self.indexes = [PrefixIndex(capacity) for _ in addresses] if method == "prefix_aware" and self.size > 1 else []

    # ------------------------------------------------------------------ routing
    def pick(self, ids: list[int]) -> int:
        if self.size == 1:
            return 0
        if self.method == "round_robin":
            k = self._next
        elif self.method == "prefix_aware":
            k = self._by_prefix(ids)
        else:
            k = self._shortest()
        self._next = (k + 1) % self.size
        if self.indexes:
            self.indexes[k].insert(ids)
        return k

    def _shortest(self, among: list[int] | None = None) -> int:
        cands = range(self.size) if among is None else among
        return min(cands, key=lambda k: (self.in_flight[k], (k - self._next) % self.size))

    def _by_prefix(self, ids: list[int]) -> int:
        matches = [idx.match(ids) for idx in self.indexes]
        best = max(matches)
        if best < PREFIX_MIN_MATCH_TOKENS or best < PREFIX_MIN_MATCH_RATIO * len(ids):
            return self._shortest()
        k = self._shortest([i for i, m in enumerate(matches) if m == best])
        least = min(self.in_flight)
        if self.in_flight[k] - least > BALANCE_ABS and self.in_flight[k] > BALANCE_REL * least:
            return self._shortest()
        return k

    # ------------------------------------------------------------------ sending
    def send_request(self, req: TokenizedGenerateReqInput) -> int:
        """Route and send one request; returns the replica."""
        t0 = time.perf_counter()
        k = self.pick(req.input_ids)
        self.route_s += time.perf_counter() - t0
        self.owner[req.rid] = k
        self.in_flight[k] += 1
        self.routed[k] += 1
        self.socks[k].send_pyobj(req)
        return k

    def send_abort(self, rid: str) -> None:
        """To the replica holding rid; nothing if it already finished (its final output arrived)."""
        k = self.owner.get(rid)
        if k is not None:
            self.socks[k].send_pyobj(AbortReq(rid))

    def send_to(self, k: int, msg: Any) -> None:
        self.socks[k].send_pyobj(msg)

    def broadcast(self, msg: Any) -> None:
        for sock in self.socks:
            sock.send_pyobj(msg)

    # ------------------------------------------------------------------ bookkeeping
    def on_finished(self, rid: str) -> None:
        """The final output of rid arrived (finished, aborted or failed)."""
        k = self.owner.pop(rid, None)
        if k is not None:
            self.in_flight[k] -= 1
            self.served[k] += 1

    def on_flushed(self, k: int) -> None:
        """Replica k emptied its radix cache: nothing it saw is cached any more."""
        if self.indexes:
            self.indexes[k].clear()

    def info(self) -> dict[str, Any]:
        return {"load_balance_method": self.method,
                "route_us_per_req": 1e6 * self.route_s / max(1, sum(self.routed))}

    def replica_stats(self, k: int) -> dict[str, Any]:
        stats: dict[str, Any] = {"num_routed_reqs": self.routed[k], "num_in_flight_reqs": self.in_flight[k],
                                 "num_served_reqs": self.served[k]}
        if self.indexes:
            stats["prefix_index_tokens"] = self.indexes[k].size
        return stats

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()
