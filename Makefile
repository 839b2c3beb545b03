# realign — set-up and everyday targets. `make install demo` on a fresh machine.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# Every pip call goes through the constraints file, also inside build isolation:
# an unpinned torch would otherwise pull gigabytes of CUDA packages.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
EXP       ?= experiments/ppo-llama2-70b-128gpu.yaml
PYTEST_ARGS ?=
# the date in the names of the benchmark records a bench target writes (UTC)
DATE      ?= $(shell date -u +%F)

.PHONY: install services lint test test-gpu test-all demo plan bench-plan bench-env bench-step bench-plans core clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0+cpu
	$(BIN)/pip install --quiet pybind11 numpy networkx pydantic PyYAML \
	    megatron-core einops psutil safetensors transformers tokenizers tensorboardX pytest pytest-xdist \
	    "ray[default]" ruff import-linter mypy pillow
	$(BIN)/pip install --quiet --no-build-isolation --no-deps -e .
	$(BIN)/python -c "import planner._core, realign; print('realign installed')"

# Rebuild the C++ core in place after editing csrc/.
core:
	$(BIN)/python setup.py build_ext --inplace -q

# Local services the `slurm` test tier starts by itself (Slurm + munge from apt, when
# missing; the tests bring the daemons up in a temporary folder and stop them), and
# Chromium for the run report's browser test (headless screenshots).
services:
	bash tests/slurm/install_slurm.sh || echo "services: Slurm unavailable, the slurm tests will skip"
	bash tests/browser/install_chromium.sh || echo "services: Chromium unavailable, the browser test will skip"

# Style, layering and types: ruff's rules, the import contracts and mypy on the planner
# and the run wing (pyproject.toml).
lint:
	$(BIN)/ruff check --no-cache realign planner tests benchmarks setup.py
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint services
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

# On a CUDA machine: the gpu tier (1 GPU: bf16 engines and a tiny GRPO run;
# 2 GPUs: an NCCL reallocation and a record transfer).
test-gpu:
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

# The main job on this machine: tiny models and data, then a two-stage pipeline on CPU
# (an SFT warm-start, then GRPO from its result; about a minute), then its report.
demo: experiments/tiny/actor/config.json
	$(BIN)/realign run experiments/demo-sft.yaml
	$(BIN)/realign run experiments/demo-grpo.yaml
	$(BIN)/realign report runs/demo-grpo

experiments/tiny/actor/config.json:
	$(BIN)/realign make-tiny experiments/tiny

plan:
	$(BIN)/realign plan $(EXP) --out out/plan.json --timeline out/plan.svg

bench-plan:
	$(BIN)/realign bench plan-sweep --json --out benchmarks/plan_sweep/ppo_h100_$(DATE).json

# The benchmark's own environment: TRL (a peer to compare against, never a dependency
# of realign) with the same pinned CPU torch and transformers as .venv.
BENCH_VENV ?= .venv-bench
bench-env:
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip setuptools wheel
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0+cpu transformers tokenizers safetensors
	$(BENCH_VENV)/bin/pip install --quiet "trl==1.16.*"
	$(BENCH_VENV)/bin/python -c "import torch, trl, transformers; print('bench env: torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"

# How true are the estimates: measure this machine once (realign profile), then run
# 10 distinct plans of the tiny GRPO and of a small four-model PPO, every MFC's estimate
# against its measurement (about 15 minutes on the 2-core machine; nothing else running).
bench-plans:
	$(BIN)/realign profile --out benchmarks/profile/cpu_$(DATE)_passes.json
	$(BIN)/realign bench plans experiments/tiny-grpo-cpu.yaml --profile benchmarks/profile/cpu_$(DATE)_passes.json --plans 10 --rounds 3 --steps 6 --warmup 2 --out benchmarks/plans/tiny_grpo_$(DATE).json --svg benchmarks/plans/tiny_grpo_$(DATE).svg
	$(BIN)/realign bench plans experiments/bench-ppo-cpu.yaml --profile benchmarks/profile/cpu_$(DATE)_passes.json --plans 10 --rounds 2 --steps 4 --warmup 1 --out benchmarks/plans/ppo_$(DATE).json --svg benchmarks/plans/ppo_$(DATE).svg

bench-step:
	$(BIN)/realign bench step experiments/tiny-grpo-cpu.yaml --steps 10 --rounds 8 --out benchmarks/step/tiny_grpo_vs_trl_$(DATE).json

clean:
	rm -rf build *.egg-info planner/_core*.so out
