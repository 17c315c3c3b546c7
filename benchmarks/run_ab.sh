#!/usr/bin/env bash
# A/B of the layer benchmarks on two source trees in one session (benchmarks/ab_trees.py:
# alternating rounds, medians, new / base per timing): the FP8 experts and layer, the dropless
# layer, and the LM train step. For a change that must not make the layer slower (a refactor).
#
#   git archive BASE_COMMIT | tar -x -C /tmp/base      # the tree to compare against
#   bash benchmarks/run_ab.sh /tmp/base OUT             # on the GPU machine, ~9 minutes
#
# Writes OUT/ab_fp8.json, OUT/ab_dropless.json, OUT/ab_lm_step.json (and their .log); each
# JSON's summary holds the geometric mean and the worst path of new / base. AB_BUDGET_S
# (default 150) caps the rounds of each benchmark.
set -u
BASE=${1:?usage: bash benchmarks/run_ab.sh BASE_TREE OUT}
OUT=${2:?usage: bash benchmarks/run_ab.sh BASE_TREE OUT}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
B=${AB_BUDGET_S:-150}
run() {
  local name=$1; shift
  timeout $((B + 200)) $PY benchmarks/ab_trees.py --base "$BASE" --rounds 3 --budget "$B" \
    --out "$OUT/ab_$name.json" -- "$@" > "$OUT/ab_$name.log" 2>&1
  echo "ab_$name: exit $?"; tail -8 "$OUT/ab_$name.log"
}
run fp8 benchmarks/experts_bench.py --part fp8 --only ceilings,experts,layer --recipes bf16,fp8_all \
  --cases ragged_balanced --layer-transports dense,dropless
run dropless benchmarks/moe_layer_bench.py --preset dropless
run lm_step benchmarks/lm_step_bench.py --variants bf16 fp8_proj
