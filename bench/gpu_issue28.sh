#!/usr/bin/env bash
# Issue 28, Part 2, in one call on a lent GPU machine (no vLLM, no network): the wheels it lacks are carried in .whl/
# (transformers 5.19.0 to match the CPU machines, hydra-core, omegaconf, antlr4 4.9.3, peft, math-verify and
# latex2sympy2_extended). Each part runs under its own time limit, so one that fails or hangs leaves the others their
# time; logs go to $OUT (at most 8 files come back). SMOKE=1 runs every part's --smoke on a CPU.
#   device run:  bash bench/gpu_issue28.sh        (carry .whl)
#   here:        SMOKE=1 OUT=/tmp/gpu28 bash bench/gpu_issue28.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$(pwd)
PY=${PY:-python3}
SMOKE_FLAG=""
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG="--smoke"; PY=${PY_SMOKE:-$ROOT/.venv/bin/python}; fi
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "$SMOKE_FLAG" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  $PY -c "import sys, torch, transformers, lightning, peft, hydra, tokenizers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'hydra', hydra.__version__, 'tokenizers', tokenizers.__version__)"
  nproc; free -g | head -2
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
cd "$ROOT/bench"
part() {  # part NAME SECONDS ARGS...: one script under its limit, its output to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local started=$(date +%s)
  timeout -k 10 "$limit" $PY "$@" $SMOKE_FLAG > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - started )) s (limit $limit s)" | tee -a "$OUT/env.log"
}
part anchor_qwen3_0.6b "${LIMIT_ANCHOR:-90}" anchor.py --model qwen3-0.6b
part e2e_qwen2.5_1.5b "${LIMIT_E2E:-210}" gpu_e2e.py --out "$OUT/e2e"
mkdir -p "$OUT/e2e"; for f in metrics.csv plan.json logs/run.log; do cp "$ROOT/.cache/lit_ppo/bench/gpu-e2e-run/$f" "$OUT/e2e/" 2>/dev/null; done
part anchor_qwen3_4b_lora "${LIMIT_ANCHOR_LORA:-150}" anchor.py --model qwen3-4b-lora
part sync_trainer_side "${LIMIT_SYNC:-90}" sync_trainer_side.py
echo "================ summaries"
for f in anchor_qwen3_0.6b anchor_qwen3_4b_lora; do echo "-- $f"; grep -E "^(actor|batch|training phase|tokens/s|MFU|anchor|wall)" "$OUT/$f.log" || tail -5 "$OUT/$f.log"; done
echo "-- e2e"; $PY gpu_e2e.py --report-only $SMOKE_FLAG --out "$OUT/e2e" 2>&1 | tail -12
echo "-- sync"; grep -E "\|" "$OUT/sync_trainer_side.log" || tail -5 "$OUT/sync_trainer_side.log"
