#!/usr/bin/env bash
# Issue-36 measurements on one GPU, in two parts (each fits one 10-minute device call):
#   bash benchmarks/run_muon_speed.sh OUT steps    # muon_step.py per NS variant + the race
#   bash benchmarks/run_muon_speed.sh OUT parity   # Muon with the plain standard NS, then
#                                                  # muon_speed.py
# OUT keeps everything; OUT/muon_speed.json is the record (after `parity`).
set -uo pipefail
out=${1:?OUT}; part=${2:?steps|parity}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
step() {  # NAME, then muon_step.py flags
  local name=$1; shift
  python benchmarks/muon_step.py --param-dtype f32 --variants muon,ns --no-optax "$@" \
    --out "$out/ms_$name.json" 2>&1 | tail -3
}
if [ "$part" = steps ]; then
  step standard --ns-method standard --symmetric-blocks 1
  step standard_sym4 --ns-method standard --symmetric-blocks 4
  step standard_tiles --ns-method standard --symmetric-blocks tiles
  step auto --ns-method auto --symmetric-blocks auto
  python examples/train_lm.py --preset gpu --optimizer both --no-progress \
    --ckpt-every 0 --out "$out/race" 2>&1 | tail -6
else
  python examples/train_lm.py --preset gpu --optimizer muon --ns-method standard \
    --ns-symmetric-blocks 1 --no-progress --ckpt-every 0 --out "$out/race_standard" 2>&1 | tail -4
  # a copy of the tree records the commit its COMMIT file names (its .git may be older)
  commit=$(cat COMMIT 2>/dev/null || git describe --always --dirty 2>/dev/null)
  python benchmarks/muon_speed.py --muon-step "$out"/ms_*.json --trainer "$out/race" \
    --trainer-standard "$out/race_standard" ${commit:+--commit "$commit"} \
    --out "$out/muon_speed.json" 2>&1 | tail -30
fi
