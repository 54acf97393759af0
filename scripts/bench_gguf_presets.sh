#!/bin/bash
# Issue 25's preset table: the default model quantised by llama.cpp's own llama-quantize to each preset, then
# for each file, in one run: radixserve's exact mode against transformers on the file, the default mode's
# drift from the exact mode beside llama.cpp's own drift on the same tokens (bench accuracy --llama-server),
# and batch-1 decode / prefill 512 beside llama-bench (bench peer).
#   bash scripts/bench_gguf_presets.sh LLAMA_BIN_DIR [OUT_DIR] [PRESETS]
# LLAMA_BIN_DIR holds llama-quantize, llama-bench and llama-server (shared/peers/build_llamacpp.sh). Quiet
# machine only; ~3 min a preset on 2 cores. PARTS=check runs only the noise-proof parts (quantize, the oracle,
# the drift), PARTS=speed only the timing (which alone needs a quiet machine); default both. DTYPE=float32 runs
# radixserve's float GEMMs in float32 (with RADIXSERVE_CPU_ISA=avx2 and an AVX2-only llama.cpp build, the
# AVX2 path of an AVX-512 machine).
set -u
cd "$(dirname "$0")/.."
source "${VENV:-.venv}/bin/activate"
BIN=${1:?usage: bench_gguf_presets.sh LLAMA_BIN_DIR [OUT_DIR] [PRESETS]}
O=${2:-out/gguf_presets}
PRESETS=${3:-Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K_M,Q4_K_S,Q4_K_M,Q5_K_M,Q6_K,IQ4_NL,IQ4_XS}
mkdir -p "$O"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$O/progress.log"; }
SRC=$(python -c "from radixserve.model_loader import default_model_path; print(default_model_path())")
F32="$O/smollm2-f32.gguf"
[ -f "$F32" ] || "$BIN/llama-quantize" --allow-requantize "$SRC" "$F32" F32 > "$O/quantize-f32.log" 2>&1
for P in ${PRESETS//,/ }; do
  G="$O/smollm2-$P.gguf"
  [ -f "$G" ] || "$BIN/llama-quantize" "$F32" "$G" "$P" > "$O/quantize-$P.log" 2>&1 || { log "$P: quantize failed"; continue; }
  if [ "${PARTS:-all}" != speed ]; then
  log "$P: exact mode vs transformers"
  python - "$G" > "$O/oracle-$P.txt" 2>&1 <<'PY'
import os, sys, torch
from transformers import AutoModelForCausalLM
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from radixserve.bench.runner_driver import RunnerDriver
path = sys.argv[1]
ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 16, 339, 260, 2951]
runner = ModelRunner(ServerArgs(model_path=path, dtype="float32", quantization="none", max_total_tokens=512))
drv = RunnerDriver(runner); row = drv.new_row()
ours = torch.log_softmax(drv.prefill(row, ids).logits_output.next_token_logits[-1].float(), -1)
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
with torch.no_grad():
    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
print(f"max |logprob - transformers| {(ours - ref).abs().max().item():.2e}  argmax equal {bool(ours.argmax() == ref.argmax())}")
PY
  log "$P: accuracy (with llama.cpp's drift)"
  radixserve bench accuracy --model-path "$G" --formats auto --num-prompts 10 --max-new-tokens 24 --threads 2 \
    --llama-server "$BIN/llama-server" --json "$O/accuracy-$P.json" > "$O/accuracy-$P.txt" 2>&1
  fi
  [ "${PARTS:-all}" = check ] && continue
  log "$P: speed against llama-bench"
  radixserve bench peer --llama-bench "$BIN/llama-bench" --model-path "$G" --threads 2 --formats auto --repeats 3 \
    --dtype "${DTYPE:-auto}" \
    --json "$O/peer-$P.json" > "$O/peer-$P.txt" 2>&1
done
log "done"
