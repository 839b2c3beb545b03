"""The ``realign`` command line: ``plan``, ``run``, ``submit``, ``bench``, ...

Each subcommand lives in its own module, which imports what it needs only when it
runs, so ``realign plan`` never imports torch. User errors (bad YAML, impossible plans)
are printed as one message without a traceback, with exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType

from realign.assets import tiny_cmd
from realign.cli import (
    bench_cmd,
    cancel_cmd,
    logs_cmd,
    plan_cmd,
    profile_cmd,
    report_cmd,
    run_cmd,
    status_cmd,
    submit_cmd,
)

# subcommand -> (module, help). Each module defines ``add_arguments(parser)`` and
# ``run(args) -> int``. An explicit table: adding a command is one line here.
COMMANDS: dict[str, tuple[ModuleType, str]] = {
    "plan": (plan_cmd, "search an execution plan for an experiment YAML"),
    "run": (run_cmd, "train an experiment on this machine (plans first)"),
    "make-tiny": (tiny_cmd, "write tiny models, tokenizer and datasets (offline)"),
    "profile": (profile_cmd, "measure this machine for the cost model (writes a profile table)"),
    "bench": (bench_cmd, "throughput studies (plan-sweep, realloc, ...)"),
    "submit": (submit_cmd, "submit an experiment as a batch job (Slurm, Ray, local)"),
    "status": (status_cmd, "state, step and last metrics of a submitted job"),
    "logs": (logs_cmd, "controller and worker logs of a submitted job"),
    "cancel": (cancel_cmd, "stop a submitted job (its last checkpoint stays usable)"),
    "report": (report_cmd, "an HTML report of a run folder (curves, times, timelines)"),
}

EXIT_USER_ERROR = 2


def _user_error_types() -> tuple[type[BaseException], ...]:
    from planner.errors import PlanError
    from realign.errors import UserError
    return (PlanError, UserError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="realign", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args._module.run(args) or 0)
    except _user_error_types() as e:
        print(f"realign {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"realign {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
