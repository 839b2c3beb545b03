"""TRL's ``GRPOTrainer`` as the peer ``realign bench step`` compares with: the
experiment's settings in TRL's terms, and one run of the driver
(:mod:`realign.bench.trl_grpo_driver`) in the benchmark's own environment
(``.venv-bench``; TRL is never a dependency of realign)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

DRIVER = Path(__file__).resolve().with_name("trl_grpo_driver.py")
#: ``beta`` given to TRL for the same-work run when the experiment's ``kl_coef`` is 0:
#: any positive value makes TRL load and run the reference model; the value itself
#: does not change the amount of work.
SAME_WORK_BETA = 1e-3


def mean_or_none(xs: list[float]) -> float | None:
    """The mean, or None for no values (a run with every step left out as warm-up)."""
    return statistics.fmean(xs) if xs else None


def trl_config(spec, steps: int, threads: int, beta: float) -> dict:
    """The driver's input: the prepared run's settings in TRL's terms."""
    cfg, p = spec.config, spec.params
    alg, data = cfg.algorithm, cfg.data.train
    ref = cfg.models.roles()["actor"]
    return {
        "model": str(Path(ref).resolve()),
        "dataset": str(Path(data.path).resolve()),
        "prompt_key": data.prompt_key, "answer_key": data.answer_key,
        "prompts_per_step": alg.prompts_per_step, "samples_per_prompt": alg.samples_per_prompt,
        "max_prompt_len": alg.prompt_len, "max_completion_len": alg.gen_len,
        "minibatches": alg.ppo_minibatches, "epochs": alg.ppo_epochs,
        "steps": steps, "threads": threads, "beta": beta,
        "clip_eps": p.clip_ratio, "lr": cfg.train.lr, "adam_eps": cfg.train.adam_eps,
        "max_grad_norm": cfg.train.clip_grad,
        "temperature": cfg.sampling.temperature, "top_k": cfg.sampling.top_k,
        "top_p": cfg.sampling.top_p, "seed": cfg.run.seed,
    }


def run_trl(python: Path, config: dict, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="realign-bench-trl-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(config))
        env = dict(os.environ, OMP_NUM_THREADS=str(config["threads"]),
                   MKL_NUM_THREADS=str(config["threads"]), TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   HF_HOME=str(Path(tmp) / "hf"), WANDB_DISABLED="true")
        env.pop("PYTHONPATH", None)
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), str(DRIVER), str(cfg_path), str(out_path)],
                              cwd=tmp, env=env, capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"the TRL driver failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        res = json.loads(out_path.read_text())
    steps = res["steps"][warmup:]
    total_s = sum(s["step_time_s"] for s in steps)
    tokens = sum(s["gen_tokens"] for s in steps)
    n = config["prompts_per_step"] * config["samples_per_prompt"]
    res["summary"] = {
        "measured_step_mean_s": mean_or_none([s["step_time_s"] for s in steps]),
        "measured_step_median_s": (statistics.median([s["step_time_s"] for s in steps])
                                   if steps else None),
        "cpu_mean_s": mean_or_none([s["cpu_s"] for s in steps]),
        "generate_mean_s": mean_or_none([s["generate_s"] for s in steps]),
        "ref_logps_mean_s": mean_or_none([s["ref_logps_s"] for s in steps]),
        "train_mean_s": mean_or_none([s["train_s"] for s in steps]),
        "gen_tokens_per_step_mean": mean_or_none([s["gen_tokens"] for s in steps]),
        "tokens_per_s": tokens / total_s if total_s > 0 else None,
        "samples_per_s": n * len(steps) / total_s if total_s > 0 else None,
        "measured_steps": len(steps),
    }
    res["wall_s_with_startup"] = wall_s
    return res
