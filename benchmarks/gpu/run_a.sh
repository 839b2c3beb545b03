#!/bin/bash
cd "$(dirname "$0")/../.."     # the repository root
. benchmarks/gpu/setup.sh
T0=$(date +%s)
realign profile --device cuda --out $OUT/profile_h100.json 2>&1 | tr '\r' '\n' | grep -v "engine .* [0-9]*/[0-9]*$" | grep -v -i warn | tail -8
echo "=== profile took $(( $(date +%s) - T0 )) s"
T0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore 2>&1 | tee $OUT/gpu_tests.log | grep -v "^  \|^$\|warn" | tail -15
echo "=== tests took $(( $(date +%s) - T0 )) s"
realign make-tiny experiments/tiny --no-qwen2 > /dev/null 2>&1
T0=$(date +%s)
timeout 240 realign bench plans benchmarks/gpu/gpu-ppo-small.yaml --profile $OUT/profile_h100.json --plans 8 --warmup 2 --steps 4 --rounds 1 --out $OUT/plans_gpu_small.json --svg $OUT/plans_gpu_small.svg 2>&1 | grep -v -i warn | tail -25
echo "=== bench took $(( $(date +%s) - T0 )) s"
