"""Dispatch over the program's ops is on their classes, exhaustively: a function that
handles each kind of op matches every class of ``Op`` and ends in ``assert_never``, so
mypy refuses a new kind of op that one of them does not handle, and at run time an
object that is no op is an error rather than a silent default."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner.graph.dataflow import MFC
from realign.run.ops import Call, Evaluate, Realloc, Release, RuleReward, Send, estimate_s, runs_ahead

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
MYPY = Path(sys.executable).parent / "mypy"
GEN = MFC(name="actor.generate", role="actor", kind="generate", n_seqs=4, prompt_len=8,
          gen_len=8, input_keys=("prompts",), output_keys=("seqs",))


def ops(ahead: bool) -> list:
    return [Realloc(1, "actor", "actor.generate", "a", "b", (0, 1), 10, 2, 0.5),
            Send(1, "seqs", (0,), (1,), (0, 1)),
            Call(1, GEN, "b", 1, (0, 1), "m", 2.0, 1.0, ahead=ahead),
            RuleReward(1, "seqs", "prompts", "rewards", (0,), ahead=ahead),
            Evaluate(1, "seqs", "prompts", "math", (0,)),
            Release(1, "b", (0, 1))]


def test_only_calls_and_rule_rewards_run_ahead():
    assert [runs_ahead(op) for op in ops(ahead=True)] == [False, False, True, True, False,
                                                           False]
    assert not any(runs_ahead(op) for op in ops(ahead=False))


def test_only_calls_and_reallocations_have_an_estimate():
    assert [estimate_s(op) for op in ops(ahead=False)] == [0.5, 0.0, 2.0, 0.0, 0.0, 0.0]


def test_an_object_that_is_no_op_is_refused():
    for fn in (runs_ahead, estimate_s):
        with pytest.raises(AssertionError):
            fn(object())     # type: ignore[arg-type]


@pytest.mark.slow
def test_mypy_refuses_a_kind_of_op_a_dispatch_does_not_handle(tmp_path):
    """ops.py with one more class in ``Op``: mypy names the functions whose match
    does not handle it."""
    source = (REPO / "realign/run/ops.py").read_text()
    union = "Op = Realloc | Send | Call | RuleReward | Evaluate | Release\n"
    assert union in source
    planted = source.replace(union, "@dataclass(frozen=True)\nclass Pause:\n"
                             "    every: int\n    ranks: tuple[int, ...]\n\n\n"
                             + union.replace("Release\n", "Release | Pause\n"))
    (tmp_path / "ops_planted.py").write_text(planted)
    (tmp_path / "ops_same.py").write_text(source)

    def mypy(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(MYPY), "--no-incremental", "--follow-imports=silent",
                               "--config-file", str(REPO / "pyproject.toml"),
                               str(tmp_path / name)], capture_output=True, text=True,
                              cwd=REPO, timeout=600)

    same, planted_run = mypy("ops_same.py"), mypy("ops_planted.py")
    assert same.returncode == 0, same.stdout
    assert planted_run.returncode == 1
    assert planted_run.stdout.count('"assert_never" has incompatible type "Pause"') == 2, \
        planted_run.stdout
