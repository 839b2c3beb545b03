"""`realign run` rejects bad input with exit code 2 before any worker starts, and runs
a plan whose actor generates and trains on different layouts (reallocating)."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics

REALIGN = [sys.executable, "-m", "realign.cli.main"]

MANUAL_REALLOC = {
    "actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "pp": 1, "dp": 2},
                       "micro_batches": 1},
    "actor.train": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 2, "pp": 1, "dp": 1},
                    "micro_batches": 2},
}


def run(exp: Path, run_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> tuple[int, str, str]:
    """``realign ARGS`` in this process (no worker starts here, and the imports are paid
    once per test process, not once per command): exit code, stdout and stderr."""
    from realign.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def bad(tiny_assets, tmp_path, name="tiny-grpo-cpu", **changes) -> str:
    """``realign run`` of the changed experiment, in this process: its stderr, after
    checking it exited 2 before any worker started."""
    exp = experiment(tiny_assets, name, tmp_path, **changes)
    code, _, text = cli("run", str(exp), "--run-dir", str(tmp_path / "run"))
    assert code == 2, (code, text[-2000:])
    assert "Traceback" not in text
    assert not (tmp_path / "run" / "logs").exists(), "no worker may start on bad input"
    return text


@pytest.mark.pure
def test_missing_dataset(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, data__train__path="tiny/nope.jsonl")
    assert "data.train" in err and "nope.jsonl" in err


@pytest.mark.pure
def test_unknown_key(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, run__stepz=3)
    assert "run.stepz" in err and "unknown key" in err and "steps" in err


@pytest.mark.pure
def test_empty_dataset(tiny_assets, tmp_path):
    (tiny_assets / "empty.jsonl").write_text("\n")
    err = bad(tiny_assets, tmp_path, data__train__path="empty.jsonl")
    assert "empty" in err


@pytest.mark.pure
def test_prompt_longer_than_the_limit(tiny_assets, tmp_path):
    (tiny_assets / "long.jsonl").write_text(json.dumps({"prompt": "1+2+3+4+5+6+7=", "answer": "28"}) + "\n")
    err = bad(tiny_assets, tmp_path, data__train__path="long.jsonl")
    assert "line 1" in err and "prompt" in err


@pytest.mark.pure
def test_preset_without_weights(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, models__actor="llama2-7b", models__ref="llama2-7b")
    assert "models.actor" in err and "checkpoint" in err


@pytest.mark.pure
def test_plan_for_another_cluster(tiny_assets, tmp_path):
    other = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, cluster__gpus_per_node=1)
    plan = tmp_path / "other-plan.json"
    code, _, err = cli("plan", str(other), "--out", str(plan))
    assert code == 0, err
    err = bad(tiny_assets, tmp_path, plan__file=str(plan))
    assert "plan.file" in err and "1x1 cpu" in err and "1x2 cpu" in err


@pytest.mark.pure
def test_infeasible_manual_allocation(tiny_assets, tmp_path):
    manual = json.loads(json.dumps(MANUAL_REALLOC))
    manual["actor.train"]["mesh"]["n_gpus"] = 4
    manual["actor.train"]["layout"]["dp"] = 2
    err = bad(tiny_assets, tmp_path, plan__manual=manual)
    assert "plan.manual.actor.train" in err and "exceed" in err


@pytest.mark.pure
def test_manual_allocation_must_cover_every_mfc(tiny_assets, tmp_path):
    manual = {k: v for k, v in MANUAL_REALLOC.items() if k != "actor.generate"}
    err = bad(tiny_assets, tmp_path, plan__manual=manual)
    assert "plan.manual" in err and "actor.generate" in err


@pytest.mark.cpu_dist
def test_a_reallocating_plan_really_reallocates_and_learns(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, plan__manual=MANUAL_REALLOC,
                     run__steps=20)
    r = run(exp, tmp_path / "run", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reallocates actor" in r.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [x["role"] for x in plan["reallocations"]] == ["actor"]
    assert "realloc actor" in (tmp_path / "run" / "plan.svg").read_text()
    planned = plan["reallocations"][0]["bytes"]
    rows = metrics(tmp_path / "run")
    assert all(row["realloc_bytes"] > 0 for row in rows)
    # the planner prices the run's own dtype (fp32 on CPU): exactly the bytes it moves
    assert plan["cost_config"]["param_dtype_bytes"] == 4
    assert rows[0]["realloc_bytes"] == planned
    first = sum(row["reward_mean"] for row in rows[:5]) / 5
    last = sum(row["reward_mean"] for row in rows[-5:]) / 5
    assert last > first + 0.05, (first, last)


@pytest.mark.pure
def test_kl_loss_without_a_reference_model(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, models__ref=None, algorithm__params__kl_coef=0.04)
    assert "models.ref" in err and "kl_coef" in err


@pytest.mark.pure
@pytest.mark.parametrize("params,field,says", [
    ({"clip_ratio": "wide"}, "algorithm.params.clip_ratio", "valid number"),
    ({"clip_ratio": -1}, "algorithm.params.clip_ratio", "greater than 0"),
    ({"kl_coeff": 0.1}, "algorithm.params.kl_coeff", "unknown hyper-parameter of grpo; allowed:"),
])
def test_a_bad_hyper_parameter_names_its_key(tiny_assets, tmp_path, params, field, says):
    err = bad(tiny_assets, tmp_path, algorithm__params=dict(params))
    assert field in err and says in err


@pytest.mark.pure
@pytest.mark.parametrize("name,params,field,says", [
    ("tiny-dapo-cpu", {"clip_ratio_high": -0.1}, "algorithm.params.clip_ratio_high",
     "greater than 0"),
    ("tiny-dapo-cpu", {"overlong_buffer_frac": 1.5}, "algorithm.params.overlong_buffer_frac",
     "less than 1"),
    ("tiny-dapo-cpu", {"dynamic_sampling": False}, "algorithm.params.dynamic_sampling",
     "only dynamic sampling drops"),
    ("tiny-gspo-cpu", {"clip_ratio": 1.5}, "algorithm.params.clip_ratio", "less than 1"),
    ("tiny-dr-grpo-cpu", {"gen_len": 8}, "algorithm.params.gen_len",
     "set gen_len on the algorithm"),
    ("tiny-rejection-sampling-cpu", {"min_reward": "high"}, "algorithm.params.min_reward",
     "valid number"),
    ("tiny-rejection-sampling-cpu", {"keep": 2}, "algorithm.params.keep",
     "unknown hyper-parameter of rejection_sampling; allowed: min_reward, loss_agg"),
    ("tiny-online-dpo-cpu", {"beta": 0}, "algorithm.params.beta", "greater than 0"),
])
def test_a_bad_hyper_parameter_of_a_new_algorithm_names_its_key(tiny_assets, tmp_path, name,
                                                                  params, field, says):
    err = bad(tiny_assets, tmp_path, name, algorithm__params=dict(params))
    assert field in err and says in err


@pytest.mark.pure
def test_only_dapo_over_generates(tiny_assets, tmp_path):
    err = bad(tiny_assets, tmp_path, algorithm__dropped_group_frac=0.25)
    assert "algorithm.dropped_group_frac" in err and "only dapo" in err


@pytest.mark.pure
def test_train_micro_batches_constrain_the_plan(tiny_assets, tmp_path):
    """``train.micro_batches`` is not silently overwritten: the searched plan uses it,
    and a manual plan with another count is refused naming both fields."""
    err = bad(tiny_assets, tmp_path, plan__manual=MANUAL_REALLOC, train__micro_batches=4)
    assert "plan.manual.actor.train" in err and "train.micro_batches" in err
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, train__micro_batches=4)
    plan = tmp_path / "p.json"
    code, _, err = cli("plan", str(exp), "--out", str(plan))
    assert code == 0, err
    allocs = {a["mfc"]: a for a in json.loads(plan.read_text())["allocations"]}
    assert allocs["actor.train"]["micro_batches"] == 4
    # the same plan file with another count is for another graph
    err = bad(tiny_assets, tmp_path, plan__file=str(plan), train__micro_batches=2)
    assert "plan.file" in err and "actor.train.micro_batches is 4 in the plan, 2 here" in err


@pytest.mark.pure
def test_submit_dry_run_of_a_cuda_run_asks_slurm_for_gpus(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, device="cuda",
                     cluster__device="a100-80g")
    code, out, err = cli("submit", str(exp), "--launcher", "slurm", "--dry-run",
                         "--run-dir", str(tmp_path / "run"))
    assert code == 0, err[-2000:]
    assert "#SBATCH --gpus-per-node=2" in out.splitlines()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["cost_config"]["param_dtype_bytes"] == 2          # bf16 on cuda
