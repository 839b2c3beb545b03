"""TRL's ``GRPOTrainer`` on a realign experiment's settings, timed per step.

Run by :mod:`realign.bench.trl_peer` (for ``realign bench step``) with the benchmark
environment's interpreter (``.venv-bench/bin/python``, ``make bench-env``), as a
script::

    python trl_grpo_driver.py CONFIG.json RESULT.json

It must not import realign (realign is not installed there, and TRL is never a
dependency of realign): the reward below is a standalone copy of the tiny task's
shaped reward, ``0.2 * digit share + 0.8 * (last number == answer)``.

Per step it records the process CPU time (all threads) and the wall time from
``on_step_begin`` to ``on_step_end`` (the same span as realign's ``step_time_s``:
generation, reference log-probs, rewards,
loss, backward, optimiser step), the generated tokens (``completion_ids``), and the
time inside generation, the reference forward and ``_generate_and_score_completions``.
"""
from __future__ import annotations

import json
import os
import platform
import re
import sys
import time

NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = [m.group().replace(",", "") for m in NUMBER.finditer(text)]
    return float(found[-1]) if found else None


def shaped_reward(response: str, answer: str) -> float:
    text = response.strip()
    digits = sum(c.isdigit() for c in text) / len(text) if text else 0.0
    got = _last_number(response)
    exact = 1.0 if got is not None and got == _last_number(str(answer)) else 0.0
    return 0.2 * digits + 0.8 * exact


def main(cfg_path: str, out_path: str) -> int:
    cfg = json.load(open(cfg_path))
    import torch
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(ln) for ln in open(cfg["dataset"]) if ln.strip()]
    data = Dataset.from_list([{"prompt": r[cfg["prompt_key"]], "answer": str(r[cfg["answer_key"]])}
                              for r in rows])
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    n_seqs = cfg["prompts_per_step"] * cfg["samples_per_prompt"]
    if n_seqs % cfg["minibatches"] != 0:
        raise SystemExit("prompts_per_step * samples_per_prompt must divide by minibatches")

    tokens_since: list[int] = []

    def reward(prompts, completions, completion_ids, answer, **_):
        tokens_since.extend(len(ids) for ids in completion_ids)
        return [shaped_reward(c, a) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir="trl_out", report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, bf16=False, fp16=False, seed=cfg["seed"], data_seed=cfg["seed"],
        dataloader_num_workers=0, disable_tqdm=True,
        max_steps=cfg["steps"],
        # one step = prompts_per_step x samples_per_prompt sequences, generated once and
        # trained in `minibatches` optimiser steps (realign's ppo_minibatches)
        per_device_train_batch_size=n_seqs // cfg["minibatches"],
        gradient_accumulation_steps=1,
        steps_per_generation=cfg["minibatches"],
        num_generations=cfg["samples_per_prompt"],
        num_iterations=cfg["epochs"],
        max_completion_length=cfg["max_completion_len"],
        temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"],
        beta=cfg["beta"], epsilon=cfg["clip_eps"],
        learning_rate=cfg["lr"], adam_epsilon=cfg["adam_eps"],
        max_grad_norm=cfg["max_grad_norm"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0,
        # the tiny experiments' plans do not recompute activations (their train calls
        # fit without it); TRL 1.16 turns checkpointing on by default
        activation_checkpointing=False, gradient_checkpointing=False,
    )

    phase = {"generate_s": 0.0, "ref_logps_s": 0.0, "generate_and_score_s": 0.0}

    class Timed(GRPOTrainer):
        def _generate(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate(*a, **k)
            finally:
                phase["generate_s"] += time.perf_counter() - t

        def _get_per_token_logps_and_entropies(self, model, *a, **k):
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *a, **k)
            finally:
                if self.ref_model is not None and model is self.ref_model:
                    phase["ref_logps_s"] += time.perf_counter() - t

        def _generate_and_score_completions(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                phase["generate_and_score_s"] += time.perf_counter() - t

    steps: list[dict] = []
    log_rows: list[dict] = []
    mark: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            now = time.perf_counter()
            if "begin" in mark:
                steps[-1]["interval_s"] = now - mark["begin"]
            mark["begin"] = now
            mark["cpu"] = time.process_time()
            tokens_since.clear()
            for k in phase:
                phase[k] = 0.0

        def on_step_end(self, a, state, control, **kw):
            dt = time.perf_counter() - mark["begin"]
            row = {"step": state.global_step - 1, "step_time_s": dt,
                   "cpu_s": time.process_time() - mark["cpu"],
                   "gen_tokens": sum(tokens_since), "n_seqs": len(tokens_since), **phase}
            row["train_s"] = dt - phase["generate_and_score_s"]
            steps.append(row)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                log_rows.append({"step": state.global_step,
                                 **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data,
                    processing_class=tok, callbacks=[StepTimer()])
    t0 = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - t0

    import accelerate
    import datasets
    result = {
        "config": cfg,
        "trl_args": {k: getattr(args, k) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_generations", "num_iterations",
            "max_completion_length", "beta", "epsilon", "loss_type", "scale_rewards",
            "temperature", "top_k", "top_p", "learning_rate", "activation_checkpointing",
            "use_vllm", "max_steps")},
        "ref_model_used": trainer.ref_model is not None,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "trl": trl.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
        "threads": {"torch_num_threads": torch.get_num_threads(),
                    "torch_interop_threads": torch.get_num_interop_threads(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "processes": 1},
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "model_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "train_wall_s": train_wall_s,
        "steps": steps,
        "logs": log_rows,
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
