#!/bin/bash
# The CPU-speed figures of the README's Performance section, radixserve against llama.cpp on the same
# GGUF and threads, each pair in one run: `bash scripts/bench_cpu_peer.sh LLAMA_BIN_DIR [OUT_DIR]`.
# LLAMA_BIN_DIR holds llama-bench and llama-server (build them with shared/peers/build_llamacpp.sh).
# Run it on a quiet machine: everything runs one after another. About 10 min on 2 cores.
set -u
cd "$(dirname "$0")/.."
source "${VENV:-.venv}/bin/activate"
BIN=${1:?usage: bench_cpu_peer.sh LLAMA_BIN_DIR [OUT_DIR]}
O=${2:-out/cpu_peer}
mkdir -p "$O"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$O/progress.log"; }

log "roofline"
radixserve bench roofline --json "$O/roofline.json" > "$O/roofline.txt" 2>&1
log "peer: pp512 / tg128 against llama-bench, every format"
radixserve bench peer --llama-bench "$BIN/llama-bench" --threads 2 --formats exact,auto,none,int8,int4 \
  --json "$O/peer.json" > "$O/peer.txt" 2>&1
log "one-batch: default (auto), prefill to 4096, decode batch 1..32 at context 128 / 512"
radixserve bench one-batch --threads 2 --prefill-lens 128,512,2048,4096 --batch-sizes 1,4,8,32 --context-lens 128,512 \
  --json "$O/one_batch_auto.json" --plot "$O/one_batch_auto.png" > "$O/one_batch_auto.txt" 2>&1
log "one-batch: default with a float32 KV cache (auto follows --dtype: bf16 where bf16 matmul is native)"
radixserve bench one-batch --threads 2 --prefill-lens 512 --batch-sizes 1,32 --context-lens 512 --kv-cache-dtype float32 \
  --json "$O/one_batch_auto_f32kv.json" > "$O/one_batch_auto_f32kv.txt" 2>&1
log "one-batch: the exact mode (float32 weights: the previous default's figures)"
radixserve bench one-batch --threads 2 --quantization none --dtype float32 --prefill-lens 128,512,2048,4096 \
  --batch-sizes 1,4,8,32 --context-lens 128,512 --json "$O/one_batch_exact.json" > "$O/one_batch_exact.txt" 2>&1
log "serving: random 200 in / 128 out, 64 requests, concurrency 32, against llama-server -np 16 -fa"
radixserve bench serving-peer --llama-server "$BIN/llama-server" --np 16 --threads 2 --json "$O/serving_peer.json" -- \
  --dataset random --num-requests 64 --input-len-range 200,200 --output-len-range 128,128 --concurrency 32 --seed 0 \
  > "$O/serving_peer.txt" 2>&1
log "accuracy: drift from the exact mode, with llama.cpp's own on the same file and tokens"
radixserve bench accuracy --formats auto,int8,int4 --llama-server "$BIN/llama-server" --threads 2 \
  --json "$O/accuracy.json" > "$O/accuracy.txt" 2>&1
log "done"
