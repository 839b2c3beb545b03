#!/usr/bin/env bash
# Generation that refills its slots vs static waves, interleaved rounds of `realign run`
# on the synchronous variant of experiments/tiny-reason-async-cpu.yaml with 8 prompts x 4
# samples a step (32 rollouts, 16 per rank) and a manual plan whose generate call runs 4
# waves per rank (a KV cache of 4 rows: the searched plan puts every rank's rows in one
# wave on this CPU, where refill changes nothing), STEPS steps; the waves run with
# rollout.refill: false. Each run's metrics.jsonl and plan.json are kept under
# $OUT/<mode>-<round>/. Usage, from the repository root after `realign make-tiny
# experiments/tiny`: benchmarks/packing/refill_runs.sh ROUNDS OUT STEPS SEED
# (the YAMLs are written to experiments/_bench_*.yaml and removed at the end)
set -euo pipefail
ROUNDS=${1:-3}; OUT=${2:-/tmp/refillbench}; STEPS=${3:-20}; SEED=${4:-0}
mkdir -p "$OUT"
for mode in refill waves; do
  sed -e "s/^name: .*/name: reason-sync-$mode/" -e 's/  max_staleness: 1/  max_staleness: 0/' \
      -e 's/  prompts_per_step: 2/  prompts_per_step: 8/' \
      -e "s/  steps: 60/  steps: $STEPS/" -e 's/  checkpoint_interval: 10/  checkpoint_interval: 100/' \
      -e "s/^  seed: 0/  seed: $SEED/" \
      -e "s|  dir: runs/{name}|  dir: $OUT/{name}|" experiments/tiny-reason-async-cpu.yaml \
      > "experiments/_bench_$mode.yaml"
  cat >> "experiments/_bench_$mode.yaml" <<'YAML'
rollout:
  refill: REFILL
YAML
  sed -i 's/^plan:/plan:\n  manual:\n    actor.generate: {mesh: {first_gpu: 0, n_gpus: 2}, layout: {tp: 1, pp: 1, dp: 2}, micro_batches: 4}\n    actor.train: {mesh: {first_gpu: 0, n_gpus: 2}, layout: {tp: 1, pp: 1, dp: 2}, micro_batches: 1}/' \
      "experiments/_bench_$mode.yaml"
done
sed -i 's/  refill: REFILL/  refill: true/' experiments/_bench_refill.yaml
sed -i 's/  refill: REFILL/  refill: false/' experiments/_bench_waves.yaml
source "$(dirname "$0")/rounds.sh"
run_rounds "$ROUNDS" "$OUT" refill waves
