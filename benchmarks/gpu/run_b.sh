#!/bin/bash
cd "$(dirname "$0")/../.."     # the repository root
. benchmarks/gpu/setup.sh
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore tests/gpu/test_cuda_single_gpu.py -k plain_and_megatron 2>&1 | tee $OUT/gpu_test2.log | grep -v "^  \|^$\|warn" | tail -12
realign make-tiny experiments/tiny --no-qwen2 > /dev/null 2>&1
python3 - <<'PY'
from realign.assets.tiny import SMALL_LLAMA, make_model, build_tokenizer
tok = build_tokenizer()
for name, h, f, L in (("medium", 1024, 2816, 8), ("large", 2048, 5632, 16)):
    arch = dict(SMALL_LLAMA, hidden_size=h, intermediate_size=f, num_hidden_layers=L,
                num_attention_heads=16, num_key_value_heads=8)
    make_model(f"experiments/tiny/{name}_actor", "llama", "lm", seed=5, tokenizer=tok, arch=arch)
    make_model(f"experiments/tiny/{name}_reward", "llama", "value", seed=6, tokenizer=tok, arch=arch)
PY
mkdir -p runs
for e in gpu-ppo-medium gpu-ppo-large; do
  timeout 150 realign run benchmarks/gpu/$e.yaml --run-dir runs/$e 2>&1 | grep -v "^step [0-9]" | grep -v -i warn | tail -14
done
tar czf $OUT/gpu_runs.tgz runs/*/metrics.jsonl runs/*/plan.json runs/*/experiment.json 2>/dev/null
