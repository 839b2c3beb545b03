"""``realign bench STUDY ...``: one throughput study per entry of :data:`STUDIES`.

Each study module defines ``add_arguments(parser)`` and ``run(args) -> int`` and is
imported only when chosen (so a planner study never imports torch).
"""
from __future__ import annotations

import argparse
import importlib

STUDIES: dict[str, tuple[str, str]] = {
    "generate": ("realign.bench.generate", "realign's own engine against vLLM on the same "
                 "prompts: identical greedy tokens, throughput, weight update, GRPO over seeds "
                 "(run it in .venv-vllm)"),
    "async": ("realign.bench.async_bench", "the best synchronous and asynchronous plans run: "
              "measured vs predicted speed-up, learning curves over seeds"),
    "plan-sweep": ("realign.bench.plan_sweep", "searched vs heuristic plans over the PPO sweep"),
    "realloc": ("realign.bench.realloc", "parameter reallocation: bytes, lower bound, time vs naive"),
    "plans": ("realign.bench.plans", "several plans of one experiment run: estimated vs "
              "measured per MFC and iteration, Kendall tau"),
    "step": ("realign.bench.step", "one RL step: per-MFC measured vs estimated, tokens/s vs TRL GRPO"),
    "public": ("realign.bench.public", "published RLHF runs planned with the device presets: "
               "estimate / measured per run and phase, median and worst"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study", required=True)
    for name, (module, help_text) in STUDIES.items():
        # add_help=False: `-h` reaches the study's own parser (see run)
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(_study_module=module)
        # The study's own options are parsed by the study (see run): the top-level
        # parser hands over what it does not know in ``args.extra``.


def run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(args._study_module)
    p = argparse.ArgumentParser(prog=f"realign bench {args.study}")
    mod.add_arguments(p)
    return int(mod.run(p.parse_args(args.extra)) or 0)
