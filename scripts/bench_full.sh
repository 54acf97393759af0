#!/bin/bash
# The full-size benchmarks behind the README's Performance section: `make bench` or
# `bash scripts/bench_full.sh [OUT_DIR]`. Everything runs one after another (the reference machine
# has 2 cores; a benchmark sharing them with another measures nothing). Servers are started and
# stopped here on ports 30100/30101. About an hour on 2 cores.
set -u
cd "$(dirname "$0")/.."
source "${VENV:-.venv}/bin/activate"
O=${1:-out/full}
mkdir -p $O
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a $O/progress.log; }
wait_ready() {
  python - "$1" <<'PY'
import sys, time, httpx
for _ in range(900):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
PY
}

# shared_prefix PORT NAME: the shared-prefix workload (8 groups x 16, 1,000-token prefix) against :PORT
shared_prefix() {
  radixserve bench serving --base-url "http://127.0.0.1:$1" --dataset shared-prefix --num-groups 8 --group-size 16 \
    --prefix-len 1000 --question-len 64 --output-len-range 16,16 --concurrency 32 --seed 0 --disable-tqdm \
    --json "$O/shared_prefix_$2.json" > "$O/shared_prefix_$2.txt" 2>&1
}

log "one-batch"
radixserve bench one-batch --profile --json $O/one_batch.json --plot $O/one_batch.png > $O/one_batch.txt 2>&1
log "roofline"
radixserve bench roofline --json $O/roofline.json > $O/roofline.txt 2>&1

log "server (radix on)"
radixserve serve --port 30100 > $O/server_on.log 2>&1 &
SP=$!
wait_ready 30100 || log "server failed"
log "serving random 128 conc 32"
radixserve bench serving --base-url http://127.0.0.1:30100 --dataset random --num-requests 128 \
  --input-len-range 100,400 --output-len-range 16,256 --concurrency 32 --seed 0 --disable-tqdm \
  --json $O/serving_random.json > $O/serving_random.txt 2>&1
log "serving shared-prefix (radix on)"
shared_prefix 30100 on
kill $SP; wait $SP 2>/dev/null

log "server (radix off)"
radixserve serve --port 30101 --disable-radix-cache > $O/server_off.log 2>&1 &
SP=$!
wait_ready 30101 || log "server failed"
log "serving shared-prefix (radix off)"
shared_prefix 30101 off
kill $SP; wait $SP 2>/dev/null

log "baseline static 16 (+ radixserve offline) on the same 128 random requests"
radixserve bench baseline --modes static --batch-size 16 --compare-radixserve --dataset random --num-requests 128 \
  --input-len-range 100,400 --output-len-range 16,256 --seed 0 --json $O/baseline_static16.json > $O/baseline_static16.txt 2>&1
log "baseline one-at-a-time vs static vs radixserve, 16 requests"
radixserve bench baseline --modes one,static --batch-size 16 --compare-radixserve --dataset random --num-requests 16 \
  --input-len-range 100,400 --output-len-range 16,256 --seed 0 --json $O/baseline_small.json > $O/baseline_small.txt 2>&1
log "dashboard: decode tok/s with 0 vs 5 metric streams (a server of its own)"
radixserve bench dashboard --dashboards 5 --rounds 5 --concurrency 8 --max-tokens 128 \
  --json $O/dashboard.json > $O/dashboard.txt 2>&1
log "done"
