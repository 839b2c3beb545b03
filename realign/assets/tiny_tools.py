"""The tiny tool task: sums of two 3-digit numbers, which the tiny model cannot
compute but can look up with a calculator tool (``experiments/tiny-tool-cpu.yaml``).

An episode, as text (``realign.agents.tool_calls``'s format)::

    123+456=                                                       the prompt
    <tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call>   turn 1
    <tool_response>579</tool_response>                             the tool's answer
    579</s>                                                        turn 2: the answer

Written into ``out_dir`` (:func:`make_tool_assets`)::

    tool_actor/            a tiny LLaMA (:data:`TOOL_LLAMA`) with the tool tokenizer (the standard tiny
                           vocabulary plus ``{}_`` and the four tags as one token
                           each, and the words ``name``, ``arguments``, ``add``)
    tool_train.jsonl, tool_eval.jsonl    {"prompt": "123+456=", "answer": "579"}
    tool_sft.jsonl         the call format to warm start on: each training problem
                           once as (prompt -> turn 1) for ``call_share`` of them
                           (else prompt -> the sum, written directly), and once as
                           (prompt + turn 1 + tool answer -> turn 2); the tool's
                           answer is in the prompt there, never a target. So the
                           warm-started model mostly answers without the tool (and
                           wrongly): GRPO has to find that calling pays.

Everything is a pure function of ``seed``.
"""
from __future__ import annotations

import random
from pathlib import Path

from realign.agents.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    format_call,
    format_response,
)
from realign.assets.tiny_base import TINY_LLAMA, build_tokenizer, make_model, write_jsonl

TOOL_SYMBOLS = "{}_"
TOOL_WORDS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, "arguments", "name",
              "add")
N_TRAIN, N_EVAL = 400, 50
#: the tool task's model: the tiny LLaMA twice as wide, with a third layer (copying
#: 3-digit operands into the call and the tool's answer out of it)
TOOL_LLAMA = dict(TINY_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=3)


def build_tool_tokenizer():
    return build_tokenizer(TOOL_SYMBOLS, TOOL_WORDS)


def add(a: int, b: int) -> str:
    """The calculator: the sum of two integers, as text."""
    return str(a + b)


def tool_problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval) ``a+b=`` problems with 3-digit ``a, b``; no eval prompt is a
    training prompt."""
    rng = random.Random(f"realign-tiny-tools:{seed}")
    seen: set[tuple[int, int]] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < N_TRAIN + N_EVAL:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows[N_EVAL:], rows[:N_EVAL]


def call_text(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return format_call("add", {"a": int(a), "b": int(b)})


def sft_rows(problems: list[dict], call_share: float, seed: int = 0) -> list[dict]:
    """The warm start's rows (see the module doc): each problem once as (prompt ->
    the call) for ``call_share`` of them, else as (prompt -> the sum written directly,
    which the model cannot compute), and once as (prompt, call and tool answer -> the
    sum)."""
    rng = random.Random(f"realign-tiny-tools-sft:{seed}")
    out = []
    for p in problems:
        call = call_text(p["prompt"])
        first = call if rng.random() < call_share else p["answer"]
        out.append({"prompt": p["prompt"], "response": first})
        out.append({"prompt": p["prompt"] + call + format_response(p["answer"]),
                    "response": p["answer"]})
    rng.shuffle(out)
    return out


def make_tool_assets(out_dir: str | Path, seed: int = 0, call_share: float = 0.3
                     ) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tool_tokenizer()
    train, evals = tool_problems(seed)
    return {"tool_actor": make_model(out / "tool_actor", "llama", "lm", seed=seed,
                                     tokenizer=tok, arch=TOOL_LLAMA),
            "tool_train": write_jsonl(out / "tool_train.jsonl", train),
            "tool_eval": write_jsonl(out / "tool_eval.jsonl", evals),
            "tool_sft": write_jsonl(out / "tool_sft.jsonl", sft_rows(train, call_share, seed))}
