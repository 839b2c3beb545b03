#!/usr/bin/env bash
# Packed vs padded, interleaved rounds of `realign run` on the synchronous variant of
# experiments/tiny-reason-async-cpu.yaml (max_staleness 0, STEPS steps; the padded one
# with train.packing: false). Each run's metrics.jsonl and plan.json are kept under
# $OUT/<mode>-<round>/. Usage, from the repository root after `realign make-tiny
# experiments/tiny`: benchmarks/packing/interleaved.sh ROUNDS OUT STEPS (the two YAMLs are
# written to experiments/_bench_*.yaml and removed at the end)
set -euo pipefail
ROUNDS=${1:-3}; OUT=${2:-/tmp/packbench}; STEPS=${3:-20}
mkdir -p "$OUT"
for mode in packed padded; do
  sed -e "s/^name: .*/name: reason-sync-$mode/" -e 's/  max_staleness: 1/  max_staleness: 0/' \
      -e "s/  steps: 60/  steps: $STEPS/" -e 's/  checkpoint_interval: 10/  checkpoint_interval: 100/' \
      -e "s|  dir: runs/{name}|  dir: $OUT/{name}|" experiments/tiny-reason-async-cpu.yaml \
      > "experiments/_bench_$mode.yaml"
done
sed -i 's/^  clip_grad: 1.0/  clip_grad: 1.0\n  packing: false/' experiments/_bench_padded.yaml
source "$(dirname "$0")/rounds.sh"
run_rounds "$ROUNDS" "$OUT" packed padded
