#!/bin/bash
# realign's own decode step, eager against captured (CUDA graphs), on an 8B-shaped model
# (random bf16 weights) at 64 and 256 rows, beside the planner's price on the H100 preset.
# Run from the repository root on the GPU machine, with .whl/ and .dev/ carried
# (benchmarks/gpu/README.md): bash benchmarks/gpu/decode_capture.sh [driver options]
# Writes $OUT/decode_capture.json, $OUT/decode_capture.log and $OUT/gpu.txt; at most 8 minutes.
set -o pipefail
source benchmarks/gpu/setup.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt"
timeout 480 python3 -m realign.bench.studies.gpu_decode_capture --out "$OUT" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/decode_capture.log"
