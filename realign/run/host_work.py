"""Host work of a step that no profile can know, because it is the experiment's own:
every worker's preparation of the step's batch from the dataset, and the rule reward
(the experiment's reward function) scoring each generated sequence. When a plan is
priced with a measured profile, the planner times both here, on this host, by running
the code the workers run (:func:`realign.data.step_batch.step_batch`,
:mod:`realign.rewards.scoring`); the cost model adds them to the estimate
(``plan.cost.batch_s``, ``plan.cost.reward_s_per_seq``; set either to fix it).

Timing at plan time makes such a plan depend on this host's speed (as the profile
does): a number set in ``plan.cost`` is used as it is.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from planner.cost.cost_config import CostModelConfig
from planner.specs.model_spec import model_presets
from realign.config.experiment import ExperimentConfig

if TYPE_CHECKING:
    from realign.data.datasets import Dataset

#: timed repetitions (the median counts)
REPS = 5
#: at most this many sequences are scored per repetition
MAX_SEQS = 64


def resolve_host_work(cfg: ExperimentConfig, cost: CostModelConfig) -> CostModelConfig:
    """``cost`` with ``batch_s`` and ``reward_s_per_seq`` resolved: kept when set, timed
    here when the plan uses a profile, else 0 (not priced)."""
    todo = [k for k in ("batch_s", "reward_s_per_seq") if getattr(cost, k) is None]
    if not todo:
        return cost
    if not cfg.plan.profile or cfg.data is None:
        return cost.model_copy(update={k: 0.0 for k in todo})
    timed = time_host_work(cfg)
    return cost.model_copy(update={k: timed[k] for k in todo})


def time_host_work(cfg: ExperimentConfig) -> dict[str, float]:
    """``{"batch_s": ..., "reward_s_per_seq": ...}`` measured on this host (the reward
    is 0 when the experiment scores with a reward model or generates nothing)."""
    from realign.data.datasets import load_dataset
    from realign.data.step_batch import step_batch
    from realign.data.tokenizer import model_tokenizer, pad_id

    role = cfg.tokenizer_role()
    ref = getattr(cfg.models, role)
    if cfg.data is None or ref is None or ref in model_presets():   # no data, or no
        return {"batch_s": 0.0, "reward_s_per_seq": 0.0}           # tokenizer to run here
    tok = model_tokenizer(ref, field=f"models.{role}")
    pad = pad_id(tok)
    data = load_dataset(cfg.data.train, tok)
    n = cfg.algorithm.shape().prompts_generated
    batch_s = _median_s(lambda k: step_batch(data, n, k, pad))
    fn = cfg.rule_reward_fn()
    return {"batch_s": batch_s,
            "reward_s_per_seq": 0.0 if fn is None else _reward_s_per_seq(fn, cfg, tok,
                                                                          data, pad)}


def _median_s(fn: Callable[[int], object]) -> float:
    times = []
    for k in range(REPS + 1):
        t0 = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _reward_s_per_seq(fn_ref: str, cfg: ExperimentConfig, tok: Any, data: Dataset,
                      pad: int) -> float:
    """Seconds to decode and score one sequence: ``MAX_SEQS`` (at most a step's) of the
    dataset's prompts, each answered with its reference answer's tokens repeated to
    the mean generation length (a rule reward scores a prompts dataset's answers)."""
    import torch

    from realign.data.datasets import PromptExample
    from realign.data.step_batch import prompts_record
    from realign.rewards.registry import load_reward_fn
    from realign.rewards.scoring import decoded_answers, scores

    fn = load_reward_fn(fn_ref)
    a = cfg.algorithm
    n = min(MAX_SEQS, a.shape().prompts_generated * a.samples_per_prompt)
    held = [e for e in data.examples if isinstance(e, PromptExample)]
    examples = [held[i % len(held)] for i in range(n)]
    gen = max(1, round(a.gen_len_mean or a.gen_len))
    rows, prompt_lens = [], []
    for e in examples:
        answer = tok.encode(str(e.answer), add_special_tokens=False) or [pad]
        rows.append(list(e.prompt_ids) + (answer * gen)[:gen])
        prompt_lens.append(len(e.prompt_ids))
    width = max(len(r) for r in rows)
    seqs = {"tokens": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "prompt_lengths": torch.tensor(prompt_lens),
            "lengths": torch.tensor([len(r) for r in rows])}
    prompts = prompts_record(examples, pad)
    return _median_s(lambda _k: scores(fn, decoded_answers(tok, seqs, prompts), 0,
                                       "sample timed while planning")) / n
