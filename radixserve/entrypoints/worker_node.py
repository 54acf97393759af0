"""`radixserve serve --nnodes N --node-rank k` with k > 0: a node that only runs ranks.

    node 0:  radixserve serve --tp-size T --pp-size P --nnodes 2 --node-rank 0 --dist-init-addr HOST:PORT
    node 1:  radixserve serve --tp-size T --pp-size P --nnodes 2 --node-rank 1 --dist-init-addr HOST:PORT

Node 0 holds the HTTP server, the TokenizerManager and rank 0; node k connects to node 0's rendezvous at
--dist-init-addr (within --dist-init-timeout), starts its share of the ranks and serves no HTTP. It
exits when the group ends: status 0 when node 0 stopped it (or on SIGTERM / Ctrl-C here, which stops the
whole group: node 0 then exits naming this node), status 1 when a rank failed anywhere, with the
message naming that rank.
"""

from __future__ import annotations

import signal
import sys
import time

from radixserve.entrypoints.launcher import launch_scheduler
from radixserve.server_args import ServerArgs

POLL_S = 0.5


def run_worker_node(server_args: ServerArgs) -> None:
    node = server_args.node_rank
    # SIGTERM behaves as Ctrl-C: it interrupts the start-up wait (the launcher then stops its ranks) or the
    # loop below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"radixserve: node {node}: joining node 0 at {server_args.dist_init_addr} ...", flush=True)
    try:
        handle = launch_scheduler(server_args)
    except KeyboardInterrupt:
        raise SystemExit(0) from None
    except (RuntimeError, OSError, ValueError) as e:
        raise SystemExit(f"radixserve: node {node}: cannot start: {e}") from None
    ranks = sorted(handle.procs)
    print(f"radixserve: node {node} ready (ranks {ranks[0]}-{ranks[-1]}); node 0 serves HTTP", flush=True)
    failure, wait_s = None, 3.0  # after node 0's ShutdownReq the ranks may be finishing a step
    try:
        while True:
            failure = handle.failure()
            if failure is not None or handle.monitor.group_ended:
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        handle.monitor.report(f"node {node} was stopped (SIGTERM / Ctrl-C)")
        failure, wait_s = None, 0.0
    finally:
        handle.stop(timeout=wait_s)
    if failure is not None:
        print(f"radixserve: node {node}: {failure}; stopping", file=sys.stderr, flush=True)
        raise SystemExit(1)
    print(f"radixserve: node {node}: stopped", flush=True)
