#!/usr/bin/env bash
# Issue-36 measurements on one GPU, in two parts (each fits one 10-minute device call):
#   bash benchmarks/run_muon_speed.sh OUT steps    # muon_step.py per ns_method + the race
#   bash benchmarks/run_muon_speed.sh OUT parity   # Muon with standard NS, then muon_speed.py
# OUT keeps everything; OUT/muon_speed.json is the record (after `parity`).
set -uo pipefail
out=${1:?OUT}; part=${2:?steps|parity}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
if [ "$part" = steps ]; then
  for m in standard gram; do
    python benchmarks/muon_step.py --param-dtype f32 --variants muon,ns --no-optax \
      --ns-method "$m" --out "$out/ms_$m.json" 2>&1 | tail -3
  done
  python benchmarks/muon_step.py --param-dtype f32 --variants muon,ns --no-optax \
    --ns-method gram --symmetric-blocks 4 --out "$out/ms_gram_sym4.json" 2>&1 | tail -3
  python examples/train_lm.py --preset gpu --optimizer both --ns-method auto --no-progress \
    --ckpt-every 0 --out "$out/race" 2>&1 | tail -6
else
  python examples/train_lm.py --preset gpu --optimizer muon --ns-method standard --no-progress \
    --ckpt-every 0 --out "$out/race_standard" 2>&1 | tail -4
  python benchmarks/muon_speed.py --muon-step "$out"/ms_*.json --trainer "$out/race" \
    --trainer-standard "$out/race_standard" --out "$out/muon_speed.json" 2>&1 | tail -30
fi
