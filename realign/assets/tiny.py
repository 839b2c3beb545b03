"""Tiny, deterministic, offline assets for ``realign run`` on a laptop and for tests:
a small tokenizer, tiny random models and a verifiable arithmetic task.

Layout written into ``out_dir``::

    actor/        LlamaForCausalLM (policy; also the reference policy) + tokenizer
    reward/       LlamaForSequenceClassification, num_labels=1 (reward model and
                  critic initialisation) + tokenizer
    qwen2_actor/  Qwen2ForCausalLM (the same task with a Qwen2 policy) + tokenizer
    small_actor/, small_reward/  the same two at ~3.2M parameters each (width 256, 4
                  layers): big enough that arithmetic, not Python, dominates a step on
                  one CPU core (``experiments/bench-ppo-cpu.yaml``)
    math_train.jsonl, math_eval.jsonl   {"prompt": "3+4=", "answer": "7"}
    prefs.jsonl                         {"prompt", "chosen", "rejected"}
    sft.jsonl                           {"prompt", "response"}

The task: ``a+b=`` with single digits ``a, b`` (100 problems; 80 for training, 20
held out for evaluation, split by ``seed``). Answers are one or two digit tokens; a
policy that emits the right digits and then ``</s>`` scores 1 under ``math_verify``.
``max_operand`` makes it easier (4: 25 problems, answers 0..8, one token each).

From the random models a plain GRPO loop learns the task, but slowly; an SFT warm
start on ``sft.jsonl`` makes it fast (benchmarks/demo/README.md).

The tokenizer and the models are built by :mod:`realign.assets.tiny_base`, which the
tool task (:mod:`realign.assets.tiny_tools`) builds on too; the names callers use are
exported here as well.

Everything is a pure function of ``seed``: two calls write byte-identical files.
"""
from __future__ import annotations

import random
from pathlib import Path

from realign.assets.tiny_base import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SMALL_LLAMA,
    TINY_LLAMA,
    TINY_QWEN3_MOE,
    WORDS,
    build_tokenizer,
    make_model,
    vocabulary,
    write_jsonl,
)
from realign.assets.tiny_tools import make_tool_assets

#: with tiny_base's names that callers of the arithmetic task use from here
__all__ = ["BOS_ID", "EOS_ID", "EVAL_FRACTION", "PAD_ID", "SMALL_LLAMA", "TINY_LLAMA",
           "TINY_QWEN3_MOE", "WORDS", "build_tokenizer", "make_model", "make_tiny_assets",
           "math_problems", "preference_pairs", "sft_rows", "vocabulary", "write_jsonl"]

EVAL_FRACTION = 0.2


# ---- datasets ----------------------------------------------------------------------

def math_problems(seed: int = 0, max_operand: int = 9) -> tuple[list[dict], list[dict]]:
    """All ``a+b=`` problems with ``0 <= a, b <= max_operand``, shuffled by ``seed`` and
    split into (train, eval) with ``EVAL_FRACTION`` held out."""
    if not 1 <= max_operand <= 9:
        raise ValueError(f"max_operand must be in 1..9 (single digits), got {max_operand}")
    r = range(max_operand + 1)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in r for b in r]
    random.Random(f"realign-tiny-math:{seed}").shuffle(rows)
    n_eval = round(len(rows) * EVAL_FRACTION)
    return rows[n_eval:], rows[:n_eval]


def preference_pairs(problems: list[dict], seed: int = 0) -> list[dict]:
    """One pair per problem: the right answer is chosen, a wrong number rejected (from
    0..max answer of the set)."""
    rng = random.Random(f"realign-tiny-prefs:{seed}")
    top = max(int(p["answer"]) for p in problems)
    out = []
    for p in problems:
        wrong = rng.choice([s for s in range(max(top, 1) + 1) if str(s) != p["answer"]])
        out.append({"prompt": p["prompt"], "chosen": p["answer"], "rejected": str(wrong)})
    return out


def sft_rows(problems: list[dict]) -> list[dict]:
    """Prompt/response rows: the response is the answer alone (``</s>`` follows it)."""
    return [{"prompt": p["prompt"], "response": p["answer"]} for p in problems]


# ---- everything --------------------------------------------------------------------

def make_tiny_assets(out_dir: str | Path, seed: int = 0, qwen2: bool = True,
                     max_operand: int = 9, small: bool = True, families: bool = True,
                     tools: bool = True) -> dict[str, Path]:
    """Write the tiny tokenizer, models and datasets into ``out_dir`` (created if
    needed; existing files of the same names are overwritten). Returns the paths by
    name: ``actor``, ``ref`` (= actor), ``reward``, ``critic`` (= reward),
    ``qwen2_actor`` (when ``qwen2``), ``llama31_actor`` and ``qwen3_actor`` (when
    ``families``), ``small_actor`` and ``small_reward`` (when ``small``), ``math_train``,
    ``math_eval``, ``prefs``, ``sft``, and with ``tools`` the tool task's
    (:func:`realign.assets.tiny_tools.make_tool_assets`).
    ``max_operand`` (1..9) bounds the operands of the arithmetic task."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    paths: dict[str, Path] = {}
    paths["actor"] = make_model(out / "actor", "llama", "lm", seed=seed, tokenizer=tok)
    paths["ref"] = paths["actor"]
    paths["reward"] = make_model(out / "reward", "llama", "value", seed=seed + 1, tokenizer=tok)
    paths["critic"] = paths["reward"]
    if qwen2:
        paths["qwen2_actor"] = make_model(out / "qwen2_actor", "qwen2", "lm", seed=seed + 2,
                                          tokenizer=tok)
    if families:            # this year's families: LLaMA 3.1's rope scaling, Qwen3
        paths["llama31_actor"] = make_model(out / "llama31_actor", "llama31", "lm",
                                            seed=seed, tokenizer=tok)
        paths["qwen3_actor"] = make_model(out / "qwen3_actor", "qwen3", "lm", seed=seed,
                                          tokenizer=tok)
    if small:
        paths["small_actor"] = make_model(out / "small_actor", "llama", "lm", seed=seed + 3,
                                          tokenizer=tok, arch=SMALL_LLAMA)
        paths["small_reward"] = make_model(out / "small_reward", "llama", "value",
                                           seed=seed + 4, tokenizer=tok, arch=SMALL_LLAMA)
    train, evals = math_problems(seed, max_operand)
    paths["math_train"] = write_jsonl(out / "math_train.jsonl", train)
    paths["math_eval"] = write_jsonl(out / "math_eval.jsonl", evals)
    paths["prefs"] = write_jsonl(out / "prefs.jsonl", preference_pairs(train, seed))
    paths["sft"] = write_jsonl(out / "sft.jsonl", sft_rows(train))
    if tools:
        paths.update(make_tool_assets(out, seed))
    return paths
