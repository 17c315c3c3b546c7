#!/usr/bin/env bash
# Run every benchmark on this machine (2x H200 by default), then merge and plot.
#
#   bash benchmarks/run_gpu.sh OUT            # real sizes (GPU), ~9 minutes at most
#   bash benchmarks/run_gpu.sh OUT --small    # CPU plumbing check (each script's --small)
#
# Each run (a script, or one --part of one) is named: it runs under `timeout` (continue on
# failure) with PYTHONUNBUFFERED=1 and writes OUT/<name>.json and OUT/<name>.log (names:
# experts_bench, muon_step, muon_step_f32, moe_layer_bench, dispatch_check = dispatch_bench.py
# --part check, dispatch_phases = dispatch_bench.py --part phases, lm_step_bench);
# OUT/run_status.tsv records exit code, seconds and limit per run; then benchmarks/collect.py
# writes OUT/h200x2.json and benchmarks/plot_results.py writes OUT/plot_*.png (SVG without matplotlib). Profiler traces
# go under OUT/traces; PACK=file.tgz packs OUT into one archive at the end. Environment:
# BENCH_BUDGET_S (total seconds for the scripts, default 530; 1200 with --small) and
# <NAME>_TIMEOUT (e.g. LM_STEP_BENCH_TIMEOUT=200) per run. A file COMMIT in the tree (an
# exported snapshot has no .git) names the commit in env.txt.
# NCCL_* and XLA_FLAGS from the environment are left as they are.
set -u
OUT=${1:?usage: bash benchmarks/run_gpu.sh OUT [--small]}
shift
SMALL=""
for arg in "$@"; do
  case "$arg" in
    --small) SMALL="--small" ;;
    *) echo "run_gpu.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT" "$OUT/traces"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
if [ -n "$SMALL" ]; then BUDGET=${BENCH_BUDGET_S:-1200}; else BUDGET=${BENCH_BUDGET_S:-530}; fi
START=$SECONDS
STATUS="$OUT/run_status.tsv"
printf 'script\trc\tseconds\tlimit_s\n' > "$STATUS"

{
  echo "date: $(date -u +%FT%TZ)"; echo "host: $(hostname)"; echo "git: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1

# run NAME DEFAULT_LIMIT_S SCRIPT ARGS...
run() {
  local name=$1 limit=$2 script=$3
  shift 3
  local var
  var="$(echo "$name" | tr '[:lower:]' '[:upper:]')_TIMEOUT"
  limit=${!var:-$limit}
  local left=$((BUDGET - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ ! -f "$script" ] || [ "$limit" -lt 15 ]; then
    echo "=== $name: skipped ($( [ -f "$script" ] && echo "only ${left}s left" || echo "no $script"))"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$STATUS"
    return
  fi
  echo "=== $name (limit ${limit}s): $PY $script $* $SMALL"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$PY" "$script" "$@" $SMALL > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" >> "$STATUS"
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: rc=$rc in ${dt}s"
}

run experts_bench 110 benchmarks/experts_bench.py --part experts \
  --out "$OUT/experts_bench.json" --configs bf16
run muon_step 100 benchmarks/muon_step.py --out "$OUT/muon_step.json" \
  --trace-dir "$OUT/traces/muon_step"
run muon_step_f32 100 benchmarks/muon_step.py --out "$OUT/muon_step_f32.json" \
  --param-dtype f32 --variants muon,optax,optax_fsdp,muon_fsdp
run moe_layer_bench 120 benchmarks/moe_layer_bench.py --out "$OUT/moe_layer_bench.json" \
  --profile "$OUT/traces/moe_layer"
run dispatch_check 90 benchmarks/dispatch_bench.py --part check --out "$OUT/dispatch_check.json"
run dispatch_phases 75 benchmarks/dispatch_bench.py --part phases \
  --out "$OUT/dispatch_phases.json"
run lm_step_bench 90 benchmarks/lm_step_bench.py --out "$OUT/lm_step_bench.json" \
  --profile "$OUT/traces/lm_step"

echo "=== scripts done in $((SECONDS - START))s"
# Keep the traces small enough to fetch: drop xplane.pb where a trace.json.gz has the same run
# (KEEP_TRACES=1 keeps everything).
if [ "${KEEP_TRACES:-0}" != "1" ]; then
  find "$OUT/traces" -name '*.xplane.pb' 2>/dev/null | while read -r f; do
    ls "$(dirname "$f")"/*.trace.json.gz > /dev/null 2>&1 && rm -f "$f"
  done
fi
du -sh "$OUT/traces" 2>/dev/null
$PY benchmarks/collect.py "$OUT" --name h200x2 || echo "collect.py failed"
$PY benchmarks/plot_results.py "$OUT" || echo "plot_results.py failed"
echo "=== total $((SECONDS - START))s; summary: $OUT/h200x2.json"
# PACK=path.tgz: also pack OUT into one archive (for transports that fetch only a few files).
if [ -n "${PACK:-}" ]; then
  tar czf "$PACK" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "packed $PACK"
fi
