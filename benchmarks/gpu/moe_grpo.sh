#!/bin/bash
# GRPO with a Qwen3-MoE actor of about 1.2B total parameters on ONE GPU, realign's own
# engine, each call's estimate against its measurement (issue 46). Run from anywhere:
#
#   bash benchmarks/gpu/moe_grpo.sh                       # the GPU machine ($OUT set)
#   MOE_GRPO_CPU=1 OUT=/tmp/moe bash benchmarks/gpu/moe_grpo.sh   # tiny model, 3 steps, CPU
#
# The model: Qwen3-30B-A3B's proportions at width 1024 (16 layers, 16 query heads of 64,
# 2 KV heads, 64 experts of moe_intermediate_size 384, top 8, norm_topk_prob, router
# aux loss 0.001), random weights saved and run in bf16; the tiny tokenizer (69 tokens). The
# experiment is gpu-grpo-moe.yaml (h100-80g preset, no profile);
# realign.bench.studies.gpu_summarize_runs also prices the plan's allocations with
# profile_h100_2026-11-24.json. Writes under $OUT:
# moe_grpo_estimates.json (the table's numbers, the run's rows, versions), plan.json,
# metrics.jsonl, experiment.json, model_config.json, run.log.
cd "$(dirname "$0")/../.."     # the repository root
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
if [ -n "$MOE_GRPO_CPU" ]; then
  export PATH=$PWD/.venv/bin:$PATH PYTHONWARNINGS=ignore
  PY=.venv/bin/python; SCALE=cpu; WARMUP=1; PROFILE=()
  MODEL=experiments/tiny/moe_cpu_actor EXP=runs/gpu-grpo-moe-cpu.yaml RUN=runs/gpu-grpo-moe-cpu
else
  . benchmarks/gpu/setup.sh
  PY=python3; SCALE=gpu; WARMUP=2
  PROFILE=(--profile benchmarks/gpu/profile_h100_2026-11-24.json)
  MODEL=experiments/tiny/moe1b_actor EXP=benchmarks/gpu/gpu-grpo-moe.yaml RUN=runs/gpu-grpo-moe
fi
mkdir -p runs "$OUT"
realign make-tiny experiments/tiny --no-qwen2 > /dev/null 2>&1 || { echo "make-tiny failed"; exit 3; }
$PY - "$SCALE" "$MODEL" <<'PY' || exit 3
import json, sys, time
from pathlib import Path

import torch
import yaml

from realign.assets.tiny import TINY_QWEN3_MOE, build_tokenizer, make_model
from realign.runtime.hf_checkpoint import spec_from_hf

scale, model = sys.argv[1:3]
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 x 128 query heads, 4 KV heads, 128 experts of
# 768, top 8. Here: width 1024, experts' width 384 (the same 0.375 of the width), heads
# of 64 at the same 8:1 query/KV ratio, 64 experts, top 8.
arch = {"gpu": dict(TINY_QWEN3_MOE, hidden_size=1024, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                    intermediate_size=3072, num_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=384, mlp_only_layers=[], decoder_sparse_step=1,
                    norm_topk_prob=True, router_aux_loss_coef=0.001),
        "cpu": dict(TINY_QWEN3_MOE, mlp_only_layers=[], num_hidden_layers=2)}[scale]
t = time.time()
torch.set_default_dtype(torch.bfloat16)     # a bf16 checkpoint: half the bytes to write
folder = make_model(model, "qwen3_moe", seed=7, tokenizer=build_tokenizer(), arch=arch)
spec = spec_from_hf(folder)
print(f"model {folder}: {spec.total_params() / 1e6:.1f}M total, {spec.active_params() / 1e6:.1f}M "
      f"active parameters ({spec.n_layers} layers, {spec.moe.n_experts} experts, top "
      f"{spec.moe.top_k}, vocabulary {spec.vocab_size}); made in {time.time() - t:.0f} s")
exp = yaml.safe_load(Path("benchmarks/gpu/gpu-grpo-moe.yaml").read_text())
if scale == "cpu":      # the same experiment, tiny and on this machine's CPU
    gpu_dir = Path("benchmarks/gpu").resolve()
    exp["models"]["actor"] = str(Path(folder).resolve())
    exp["data"]["train"]["path"] = str((gpu_dir / exp["data"]["train"]["path"]).resolve())
    fn_file, fn = exp["reward"]["fn"].split(":")
    exp["reward"]["fn"] = f"{(gpu_dir / fn_file).resolve()}:{fn}"
    exp["algorithm"].update(prompts_per_step=4, gen_len=8)
    exp["data"]["train"]["max_response_len"] = 8
    exp["cluster"]["device"], exp["device"] = "cpu", "cpu"
    exp["run"]["steps"] = 3
    exp["name"] = "gpu-grpo-moe-cpu"
    Path("runs/gpu-grpo-moe-cpu.yaml").write_text(yaml.safe_dump(exp, sort_keys=False))
PY
cp "$MODEL/config.json" "$OUT/model_config.json"
rm -rf "$RUN"
echo "=== assets took $(( $(date +%s) - T0 )) s"
T1=$(date +%s)
timeout 360 realign run "$EXP" --run-dir "$RUN" > "$OUT/run.log" 2>&1
echo "=== realign run exited $? after $(( $(date +%s) - T1 )) s"
grep -v "^step [0-9]" "$OUT/run.log" | grep -v -i warn | tail -12
cp "$RUN/metrics.jsonl" "$RUN/plan.json" "$RUN/experiment.json" "$OUT/" 2>/dev/null
$PY -m realign.bench.studies.gpu_summarize_runs "$RUN" --warmup $WARMUP "${PROFILE[@]}" \
    --out "$OUT/moe_grpo_estimates.json"
echo "=== the script took $(( $(date +%s) - T0 )) s"
