#!/usr/bin/env bash
# Issue 41 in one call on a lent GPU machine (no vLLM, no flash-attn, no network; Python 3.12, torch 2.11). The wheels
# its image lacks are carried in .whl/ (`make gpu-wheels` builds them here, 14 MB: transformers 5.19.0 to match the
# CPU machines, hydra-core, omegaconf, antlr4 4.9.3, peft, math-verify, latex2sympy2_extended).
#
#   device tool:  run(command="bash bench/gpu_issue41.sh", carry=[".whl"], timeout_s=600)
#                 then, at once (the machine stays warm 30 s; its /tmp/site keeps the wheels), rerun a part that
#                 failed: run(command="PARTS=<name> BUDGET_S=<what the lease has left - 60> bash bench/gpu_issue41.sh")
#   here:         SMOKE=1 OUT=/tmp/gpu41 bash bench/gpu_issue41.sh      (every part's --smoke on the CPU, vLLM and
#                 flash-attn made unimportable by bench/no_vllm/sitecustomize.py, as on the GPU machine)
#   one part:     PARTS="async" bash bench/gpu_issue41.sh               (names below; default: all, in this order)
#
# Parts, in priority order, each under its own limit (LIMIT_<NAME> overrides it) and all under BUDGET_S (default 450 s
# from the script's start: with the machine's start, 15 minutes of device time then leave a rerun of one part): a part starts only with at least 30 s of the budget left and runs
# under min(its limit, what is left), so the parts at the end are the ones cut. Expected seconds on one H100/H200 (estimates from
# issue 28's H200 run, not measurements): e2e7b ~170 (limit 230), anchor 4B ~60 (80), anchor 7B ~70 (95), anchor 0.6B
# ~45 (60), shared_prefix ~50 (80) = limits 545 (the budget cuts the last); then async ~2 x 60 (90 each) if time is left.
#   1. e2e7b: `+experiment=qwen7b_lora rollout.engine=hf` at the Qwen2.5-7B shape, random weights, 16 prompts x 4
#      samples, responses <= 256, 3 rollout steps (bench/gpu_e2e.py --shape qwen2.5-7b).
#   2. anchor: the anchor's training-phase protocol with model.attn_implementation=flex_attention: Qwen3-4B LoRA r16,
#      Qwen2.5-7B LoRA r16, Qwen3-0.6B full (bench/anchor.py --attn flex_attention), tok/s and both MFU counts.
#   3. shared_prefix: shared-prefix vs flat packed layout, training phase, n = 8, 1,000-token prompts, 500-token
#      responses, Qwen3-0.6B shape (bench/shared_prefix.py --accelerator gpu).
#   4. async: one HF-engine rollout worker sharing the GPU (rollout.mode=disaggregated, k = 1,
#      rollout.workers.devices=0) against colocated, Qwen2.5-1.5B shape, and the weight push (bench/gpu_e2e.py --mode).
# Logs go to $OUT, 8 files at most: env.log (timings and the summary), e2e7b.log, e2e7b_metrics.csv, e2e7b_plan.json,
# anchor.log, shared_prefix.log, async.log, async_metrics.csv.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$(pwd)
PY=${PY:-python3}
SMOKE_FLAG=""
STARTED=$(date +%s)
BUDGET_S=${BUDGET_S:-450}
PARTS=${PARTS:-e2e7b anchor shared_prefix async}
: "${OUT:?set OUT to the folder for the logs}"
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_FLAG="--smoke"; PY=${PY_SMOKE:-$ROOT/.venv/bin/python}; BUDGET_S=${BUDGET_S_SMOKE:-1800}
  export PYTHONPATH="$ROOT/bench/no_vllm${PYTHONPATH:+:$PYTHONPATH}"  # vLLM and flash-attn unimportable, as there
fi
mkdir -p "$OUT"
if [ ! -d .whl ] && [ -z "$SMOKE_FLAG" ]; then
  echo "gpu_issue41: no .whl/ here; fix: make gpu-wheels on the CPU machine, then run with carry [\".whl\"]" | tee "$OUT/env.log"
  exit 1
fi
if [ -d .whl ] && [ -z "$SMOKE_FLAG" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# Models, prompts and run directories in memory where there is room (writing the 7B model and a 1.5B run's final
# checkpoint to disk took a minute on issue 28's machine); each run directory is removed after its part, and the 7B
# and 4B models after the anchors (at most ~35 GB there at once: the async part's 1.5B run writes ~30 GB).
if [ -z "$SMOKE_FLAG" ] && [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge 40 ] 2>/dev/null; then
  export LIT_PPO_BENCH_CACHE=/dev/shm/lit_ppo_bench
fi
CACHE=${LIT_PPO_BENCH_CACHE:-$ROOT/.cache/lit_ppo/bench}
WORK=$(mktemp -d)
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  $PY -c "import sys, torch, transformers, lightning, peft, hydra, tokenizers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'hydra', hydra.__version__, 'tokenizers', tokenizers.__version__)"
  $PY -c "import importlib.util as u; print('vllm importable:', u.find_spec('vllm') is not None, '; flash_attn importable:', u.find_spec('flash_attn') is not None)"
  nproc; free -g | head -2; df -h /dev/shm . 2>&1 | tail -2; echo "cache: $CACHE; budget $BUDGET_S s; parts: $PARTS"
} >> "$OUT/env.log" 2>&1
cat "$OUT/env.log"
cd "$ROOT/bench"
wanted() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
run_part() {  # run_part NAME LIMIT LOG ARGS...: one script under min(LIMIT, the budget left), its output appended to LOG
  local name=$1 limit=$2 log=$3; shift 3
  local left=$(( BUDGET_S - ($(date +%s) - STARTED) ))
  RC=skipped
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s of the ${BUDGET_S} s budget left" | tee -a "$OUT/env.log"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$(date +%s)
  echo "######## $name: $PY $* $SMOKE_FLAG (limit $limit s)" >> "$log"
  timeout -k 10 "$limit" $PY "$@" $SMOKE_FLAG >> "$log" 2>&1
  RC=$?
  echo "== $name: exit $RC after $(( $(date +%s) - started )) s (limit $limit s)" | tee -a "$OUT/env.log"
  [ "$RC" != 0 ] && tail -n 3 "$log" | cut -c1-300 | sed 's/^/==     /' | tee -a "$OUT/env.log"
}
partial_report() {  # partial_report RUN_DIR LOG: a cut or failed run's report from the steps metrics.csv holds
  if [ "$RC" != 0 ] && [ "$RC" != skipped ] && [ -f "$1/metrics.csv" ] && [ -f "$1/plan.json" ]; then
    echo "######## the steps it finished (gpu_e2e.py --report-only)" >> "$2"
    timeout 30 $PY gpu_e2e.py --report-only --run-dir "$1" --out "$WORK/unused" $SMOKE_FLAG >> "$2" 2>&1
  fi
}
if wanted e2e7b; then
  run_part e2e7b "${LIMIT_E2E7B:-230}" "$OUT/e2e7b.log" gpu_e2e.py --shape qwen2.5-7b --prompts 16 --samples 4 \
    --response-tokens 256 --steps 3 --run-dir "$CACHE/e2e7b-run" --out "$WORK/e2e7b"
  partial_report "$CACHE/e2e7b-run" "$OUT/e2e7b.log"
  cp "$CACHE/e2e7b-run/metrics.csv" "$OUT/e2e7b_metrics.csv" 2>/dev/null; cp "$CACHE/e2e7b-run/plan.json" "$OUT/e2e7b_plan.json" 2>/dev/null
  rm -rf "$CACHE/e2e7b-run"
fi
if wanted anchor; then
  # flex attention has not run on a GPU in this project before: if the 7B row fails (not cut by its limit: 124, 137)
  # it runs again with sdpa, so that it has a figure either way (issue 28 measured the other two rows with sdpa).
  for row in "qwen3-4b-lora ${LIMIT_ANCHOR_4B:-80}" "qwen2.5-7b-lora ${LIMIT_ANCHOR_7B:-95}" "qwen3-0.6b ${LIMIT_ANCHOR_06B:-60}"; do
    set -- $row
    run_part "anchor_${1}_flex" "$2" "$OUT/anchor.log" anchor.py --model "$1" --attn flex_attention --steps 3
    if [ "$RC" != 0 ] && [ "$RC" != 124 ] && [ "$RC" != 137 ] && [ "$RC" != skipped ] && [ "$1" = qwen2.5-7b-lora ]; then
      run_part "anchor_${1}_sdpa" "$2" "$OUT/anchor.log" anchor.py --model "$1" --attn sdpa --steps 3
    fi
  done
  rm -rf "$CACHE/anchor-run"
  [ -z "$SMOKE_FLAG" ] && rm -rf "$CACHE/gpu-e2e-qwen2.5-7b-0" "$CACHE/anchor-qwen3-4b-lora"
fi
if wanted shared_prefix; then
  run_part shared_prefix_qwen3_0.6b "${LIMIT_SHARED:-80}" "$OUT/shared_prefix.log" shared_prefix.py --accelerator gpu \
    --model qwen3-0.6b --prompts 4 --samples-per-prompt 8 --prompt-tokens 1000 1000 --response-lengths 500 \
    --train-batch-size 16 --micro-batch-size 16 --steps 3 --repeats 1
  rm -rf "$CACHE/shared-prefix-train-phase"
fi
if wanted async; then
  for mode in colocated disaggregated; do
    run_part "async_$mode" "${LIMIT_ASYNC:-90}" "$OUT/async.log" gpu_e2e.py --shape qwen2.5-1.5b --mode $mode \
      --prompts 8 --samples 4 --response-tokens 128 --steps 4 --run-dir "$CACHE/async-run" --out "$WORK/async-$mode"
    partial_report "$CACHE/async-run" "$OUT/async.log"
    [ -f "$CACHE/async-run/logs/rollout_worker0.log" ] && { echo "######## rollout_worker0.log"; cat "$CACHE/async-run/logs/rollout_worker0.log"; } >> "$OUT/async.log"
    [ "$mode" = disaggregated ] && cp "$CACHE/async-run/metrics.csv" "$OUT/async_metrics.csv" 2>/dev/null
    rm -rf "$CACHE/async-run"
  done
fi
REPORT='^(device|plan  |workers|step \||[0-9]+ \||median|weight sync|peak device|wall)'
{
  echo "================ summary ($(( $(date +%s) - STARTED )) s)"
  grep -E '^== ' "$OUT/env.log"
  if wanted e2e7b; then echo "-- 1. e2e, +experiment=qwen7b_lora rollout.engine=hf, Qwen2.5-7B shape"; grep -E "$REPORT" "$OUT/e2e7b.log" 2>/dev/null || tail -5 "$OUT/e2e7b.log"; fi
  if wanted anchor; then echo "-- 2. anchor protocol, flex_attention (anchors: prime-rl, one H100)"; grep -E '^(######## |model|training phase|tokens/s|MFU|anchor)' "$OUT/anchor.log" 2>/dev/null; fi
  if wanted shared_prefix; then echo "-- 3. shared prefix vs flat packed (goal: shared >= 1.5x tok/s)"; grep -E '^(flat |shared)' "$OUT/shared_prefix.log" 2>/dev/null || tail -5 "$OUT/shared_prefix.log"; fi
  if wanted async; then echo "-- 4. one HF rollout worker on the trainer's GPU (k = 1) vs colocated, Qwen2.5-1.5B shape"; grep -E "^######## async|$REPORT" "$OUT/async.log" 2>/dev/null; fi
} > "$WORK/summary"
cat "$WORK/summary" | tee -a "$OUT/env.log"
rm -rf "$WORK"
