"""`realign run` end to end on CPU: learning, resume after SIGKILL, failures and bad
input. Real worker processes over gloo; assets are made once per session."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after, wait_for_rows
from tests.run.live_workers import workers_of
from tests.run.run_records import final_weights, metrics

pytestmark = pytest.mark.cpu_dist

REALIGN = [sys.executable, "-m", "realign.cli.main"]


def run(exp: Path, run_dir: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=timeout)


LEARN_STEPS = 24


@pytest.fixture(scope="module")
def learned(tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    """One whole tiny GRPO run of the file (its experiment, its run folder), checkpointed
    every 2 steps: the run that learns, and the uninterrupted twin of the resumed one."""
    tmp = tmp_path_factory.mktemp("learned")
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp, run__steps=LEARN_STEPS,
                     run__checkpoint_interval=2)
    r = run(exp, tmp / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    return exp, tmp / "run"


def test_grpo_learns_and_saves_a_hf_actor(tiny_assets, learned):
    run_dir = learned[1]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(LEARN_STEPS))
    first = sum(row["reward_mean"] for row in rows[:5]) / 5
    last = sum(row["reward_mean"] for row in rows[-5:]) / 5
    assert last > first + 0.08, (first, last)
    for key in ("actor.loss", "actor.grad_norm", "tokens_per_s", "time.actor.generate"):
        assert key in rows[-1], key
    assert "time.ref.inference" not in rows[-1]             # kl_coef 0 and no ref model
    assert list((run_dir / "tensorboard").iterdir())
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "actor")
    tok = AutoTokenizer.from_pretrained(run_dir / "final" / "actor")
    ids = tok("3+4=", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] >= len(tok)
    start = load_file(next((tiny_assets / "tiny" / "actor").glob("*.safetensors")))
    trained = final_weights(run_dir)
    assert any(not torch.equal(start[k], trained[k]) for k in start), "weights did not change"


def test_grpo_with_a_reference_model_scores_and_logs_the_kl(tiny_assets, tmp_path):
    """With models.ref the plan has a reference call, and the KL to the reference is
    logged (and shown) every step; without it (the shipped YAML, kl_coef 0) neither."""
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=3,
                     models__ref="tiny/actor", algorithm__params__kl_coef=0.01)
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert "ref.inference" in json.dumps(plan)
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all("time.ref.inference" in row and "kl" in row for row in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)    # ref = the actor at step 0
    assert rows[-1]["kl"] > 0
    assert " kl " in r.stderr + r.stdout


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(learned, tmp_path):
    # the learning run's 24 steps, killed after 3: room to spare (a kill after the last
    # step would find a finished run)
    exp, whole = learned
    cut = tmp_path / "cut"
    kill_after(exp, cut, 3)
    found = committed(cut)
    assert found, "no committed checkpoint before the kill"
    assert not (cut / "final").exists()
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and found[-1][1].name in r.stdout, r.stdout
    assert [row["step"] for row in metrics(cut)] == list(range(LEARN_STEPS))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [row["reward_mean"] for row in metrics(whole)] == \
        [row["reward_mean"] for row in metrics(cut)]


@pytest.fixture(scope="module")
def sharded_half(tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    """Two steps of a 4-step run checkpointed every 2, its optimizer sharded
    (train.distributed_optimizer: true): its experiment and its run folder, which each
    test copies."""
    tmp = tmp_path_factory.mktemp("sharded")
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp, run__steps=4,
                     run__checkpoint_interval=2, train__distributed_optimizer=True)
    r = run(exp, tmp / "run", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return exp, tmp / "run"


def test_partial_checkpoint_is_ignored(sharded_half, tmp_path):
    exp, rd = sharded_half[0], tmp_path / "run"
    shutil.copytree(sharded_half[1], rd)
    # a kill during the next checkpoint's write leaves a .tmp folder behind
    part = rd / "checkpoints" / "step_000004.tmp"
    part.mkdir()
    (part / "rank0.pt").write_bytes(b"truncated")
    r = run(exp, rd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "step_000002" in r.stdout
    assert (rd / "checkpoints" / "step_000004" / "manifest.json").is_file()


@pytest.mark.slow
def test_resuming_with_a_differently_sharded_optimizer_is_refused(tiny_assets, sharded_half,
                                                                  tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(sharded_half[1], rd)
    plain = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=4,
                       run__checkpoint_interval=2)    # unset: not sharded on cpu
    r = run(plain, rd)
    assert r.returncode == 2                          # refused before any worker starts
    assert "train.distributed_optimizer: true to resume" in r.stderr, r.stderr[-3000:]
    # a checkpoint from before the sharding and the file digests were recorded (in the
    # manifest and the rank files): the workers catch it by its state's shapes
    ckpt = rd / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for key in ("files", "distributed_optimizer", "trained"):
        manifest.pop(key)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    for f in ckpt.glob("rank*.pt"):
        state = torch.load(f, weights_only=False)
        for part in state.values():
            part.pop("distributed_optimizer")
        torch.save(state, f)
    r = run(plain, rd)
    assert r.returncode == 1
    assert "sharded differently (train.distributed_optimizer" in r.stderr, r.stderr[-3000:]
    assert (ckpt / "manifest.json").is_file()      # the checkpoint itself is kept
    r = run(sharded_half[0], rd)                      # resumes with the same setting
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(rd)] == list(range(4))


def test_worker_exception_names_the_worker_and_stops_everything(tiny_assets, tmp_path):
    (tiny_assets / "bad_reward.py").write_text(
        "def boom(prompt, response, answer):\n"
        "    raise ValueError('the reward function broke on ' + prompt)\n")
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, reward__fn="bad_reward.py:boom")
    t0 = time.monotonic()
    r = run(exp, tmp_path / "run", timeout=120)
    assert r.returncode == 1
    assert "worker 0 failed" in r.stderr or "worker 1 failed" in r.stderr
    assert "ValueError: the reward function broke on" in r.stderr
    assert time.monotonic() - t0 < 120
    time.sleep(1)
    assert not workers_of(tmp_path / "run")


def kill_a_worker(exp: Path, rd: Path, victim: int) -> tuple[int, str, float]:
    """``realign run`` of ``exp`` (two workers) into ``rd``, worker ``victim`` killed
    after two steps: the run's exit code, its stderr and the seconds it took to stop."""
    p = subprocess.Popen([*REALIGN, "run", str(exp), "--run-dir", str(rd)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(rd, 2)
    workers = workers_of(rd)
    assert len(workers) == 2
    os.kill(workers[victim], signal.SIGKILL)
    t0 = time.monotonic()
    _out, err = p.communicate(timeout=60)
    return p.returncode, err, time.monotonic() - t0


def test_killed_worker_is_reported_within_30s(tiny_assets, tmp_path):
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, run__steps=200)
    rd = tmp_path / "run"
    code, err, seconds = kill_a_worker(exp, rd, 1)
    assert seconds < 30
    assert code == 1
    assert "failed" in err and "worker" in err
    time.sleep(1)
    assert not workers_of(rd)
