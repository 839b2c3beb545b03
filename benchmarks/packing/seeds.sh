#!/usr/bin/env bash
# The synchronous tiny-reason variant (as interleaved.sh makes it) over SEEDS seeds
# (run.seed 0..SEEDS-1), packed and padded, STEPS steps each; metrics.jsonl of each run
# kept under $OUT/<mode>-seed<k>/. Usage, from the repository root after
# `realign make-tiny experiments/tiny`: benchmarks/packing/seeds.sh SEEDS OUT STEPS
set -euo pipefail
SEEDS=${1:-3}; OUT=${2:-/tmp/packseeds}; STEPS=${3:-30}
mkdir -p "$OUT"
for s in $(seq 0 $((SEEDS - 1))); do
  for mode in packed padded; do
    y="experiments/_bench_${mode}_s$s.yaml"
    sed -e "s/^name: .*/name: reason-seed-$mode/" -e 's/  max_staleness: 1/  max_staleness: 0/' \
        -e "s/  steps: 60/  steps: $STEPS/" -e 's/  checkpoint_interval: 10/  checkpoint_interval: 100/' \
        -e "s/^  seed: 0/  seed: $s/" -e "s|  dir: runs/{name}|  dir: $OUT/{name}|" \
        experiments/tiny-reason-async-cpu.yaml > "$y"
    if [ "$mode" = padded ]; then sed -i 's/^  clip_grad: 1.0/  clip_grad: 1.0\n  packing: false/' "$y"; fi
    rm -rf "$OUT/reason-seed-$mode"
    .venv/bin/realign run "$y" > "$OUT/$mode-seed$s.log" 2>&1
    mkdir -p "$OUT/$mode-seed$s" && cp "$OUT/reason-seed-$mode/metrics.jsonl" "$OUT/$mode-seed$s/"
    rm -f "$y"
  done
done
