"""Malformed inputs, as a new user gets them wrong, and damaged run folders: one table.

Each row makes an input (an experiment YAML, model files, a plan, a damaged run folder)
and says what ``realign`` must do with it: the exit code (2: your input, refused before
any worker starts; 1: a failure while running) and words the message must hold. Every
row also checks that no traceback is printed and, for exit code 2, that no worker
started. Add a row to add a case.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = pytest.mark.cpu_dist


@dataclass
class Case:
    name: str
    make: Callable[["Env"], list[str]]     #: the command line (after ``realign``)
    exit: int
    says: tuple[str, ...]
    then: Callable[["Env"], None] | None = None   #: more checks on the run folder
    marks: tuple = field(default_factory=tuple)


@dataclass
class Env:
    assets: Path
    tmp: Path

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    def exp(self, **changes) -> str:
        changes.setdefault("run__steps", 2)
        return str(experiment(self.assets, "tiny-grpo-cpu", self.tmp, **changes))

    def run(self, *extra: str, **changes) -> list[str]:
        return ["run", self.exp(**changes), "--run-dir", str(self.run_dir), *extra]

    def model_copy(self, edit: Callable[[Path], None]) -> str:
        """A copy of the tiny actor, edited; its path for models.actor."""
        dst = self.tmp / "actor"
        shutil.copytree(self.assets / "tiny" / "actor", dst)
        edit(dst)
        return str(dst)

    def write(self, name: str, text: str | bytes) -> str:
        p = self.tmp / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
        return str(p)


def _config(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        out = edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg if out is None else out))
    return apply


def _saved_plan(env: Env, edit: Callable[[dict], None]) -> str:
    """The tiny experiment's plan (``realign plan --out``), edited."""
    from realign.cli.main import main

    out = env.tmp / "plan.json"
    assert main(["plan", env.exp(), "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    edit(raw)
    out.write_text(json.dumps(raw))
    return str(out)


def _train_alloc(raw: dict) -> dict:
    return next(a for a in raw["allocations"] if a["mfc"] == "actor.train")


REWARDS = '''
import math
def text(prompt, response, answer): return "abc"
def nothing(prompt, response, answer): return None
def nan(prompt, response, answer): return math.nan
def inf_later(prompt, response, answer): return math.inf if "3" in prompt else 0.5
'''

MANUAL = {
    "actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "dp": 2}},
    "actor.train": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 2}},
}


def _manual(**train) -> dict:
    out = json.loads(json.dumps(MANUAL))
    out["actor.train"].update(train)
    return out


CASES = [
    # ---- the experiment file and the command line ------------------------------------
    Case("a binary file as the YAML",
         lambda e: ["run", e.write("x.yaml", bytes(range(256)) * 4)], 2,
         ("experiment", "not a text (UTF-8) file")),
    Case("a key given twice",
         lambda e: ["run", e.write("x.yaml", Path(e.exp()).read_text()
                                   + "cluster:\n  gpus_per_node: 8\n")], 2,
         ("the key 'cluster' is given twice", "lines")),
    Case("an unknown hyper-parameter", lambda e: e.run(algorithm__params__kl_coeff=0.1), 2,
         ("algorithm.params.kl_coeff", "allowed:")),
    Case("an ill-typed hyper-parameter", lambda e: e.run(algorithm__params__clip_ratio="wide"),
         2, ("algorithm.params.clip_ratio",)),
    Case("--run-dir names a file",
         lambda e: ["run", e.exp(), "--run-dir", e.write("afile", "x")], 2,
         ("--run-dir", "is a file")),
    Case("a huge --steps", lambda e: e.run("--steps", str(10 ** 30)), 2,
         ("--steps", "less than or equal to 1000000000")),
    Case("a huge run.steps", lambda e: e.run(run__steps=10 ** 30), 2,
         ("run.steps", "less than or equal to 1000000000")),
    Case("a billion nodes", lambda e: e.run(cluster__nodes=10 ** 9), 2,
         ("cluster.nodes", "less than or equal to 256")),
    Case("a prompts_per_step beyond any bound", lambda e: e.run(algorithm__prompts_per_step=10 ** 19),
         2, ("algorithm.prompts_per_step", "less than or equal")),
    Case("a prompts_per_step that fits nowhere",
         lambda e: e.run(algorithm__prompts_per_step=1 << 22, plan__time_limit_s=4), 2,
         ("fits on no mesh", "algorithm.prompts_per_step")),
    Case("a run folder that cannot be made",
         lambda e: ["run", e.exp(), "--run-dir", "/proc/no/such/run"], 2,
         ("--run-dir", "cannot make the run folder")),
    Case("an unknown device", lambda e: e.run(cluster__device="tpu"), 2,
         ("cluster.device", "unknown device 'tpu'")),
    Case("a binary profile table",
         lambda e: e.run(plan__profile=e.write("p.json", bytes(range(256)))), 2,
         ("plan.profile", "is not a")),
    Case("sequences longer than the model takes",
         lambda e: e.run(algorithm__gen_len=400, data__train__max_response_len=400), 2,
         ("algorithm.gen_len", "more than the 256 that models.actor takes")),
    Case("an eval set that overlaps the training prompts",
         lambda e: e.run(eval={"data": {"path": "tiny/math_train.jsonl", "kind": "prompts",
                                        "max_prompt_len": 8}}), 2,
         ("eval.data", "never overlaps the training prompts")),
    Case("an eval section for an algorithm that trains no actor",
         lambda e: ["run", str(experiment(e.assets, "tiny-rm-cpu", e.tmp, eval={"data": {
             "path": "tiny/math_eval.jsonl", "kind": "prompts"}})), "--run-dir", str(e.run_dir)],
         2, ("eval", "trains no actor")),
    # ---- models ------------------------------------------------------------------------
    Case("a config.json that is a list",
         lambda e: e.run(models__actor=e.model_copy(_config(lambda c: [c]))), 2,
         ("models.actor", "holds a list")),
    Case("a string for a head count",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(num_attention_heads="four")))), 2,
         ("models.actor", "num_attention_heads must be a whole number")),
    Case("zero layers",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(num_hidden_layers=0)))), 2,
         ("models.actor", "num_hidden_layers")),
    Case("an unsupported model_type",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(model_type="gpt2")))), 2,
         ("models.actor", "model_type 'gpt2' is not supported")),
    Case("a mixture of experts",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(num_local_experts=8)))), 2,
         ("models.actor", "a mixture of experts (8 experts) is not supported")),
    Case("a rope scaling realign does not compute",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(rope_scaling={"rope_type": "longrope",
                                                      "factor": 4.0})))), 2,
         ("models.actor", "rope_type 'longrope' is not supported", "llama3, yarn")),
    Case("sliding windows on some layers only",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(use_sliding_window=True, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])))),
         2, ("models.actor", "sliding windows on some layers only")),
    Case("a model folder without weights",
         lambda e: e.run(models__actor=e.model_copy(
             lambda d: (d / "model.safetensors").unlink())), 2,
         ("models.actor", "no weights")),
    Case("weights with fewer layers than the config",
         lambda e: e.run(models__actor=e.model_copy(
             _config(lambda c: c.update(num_hidden_layers=3)))), 2,
         ("models.actor", "model.layers.2.", "is missing")),
    Case("a garbage safetensors header",
         lambda e: e.run(models__actor=e.model_copy(
             lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64))), 2,
         ("models.actor", "not a readable safetensors file")),
    # ---- plans -------------------------------------------------------------------------
    Case("a manual mesh outside the cluster",
         lambda e: e.run(plan__manual=_manual(mesh={"first_gpu": 2, "n_gpus": 2})), 2,
         ("plan.manual.actor.train", "exceed")),
    Case("a manual TP the mesh cannot hold",
         lambda e: e.run(plan__manual=_manual(layout={"tp": 4})), 2,
         ("plan.manual.actor.train", "tp*pp*dp = 4 but the mesh has 2")),
    Case("a saved plan whose TP x PP x DP is not the mesh size",
         lambda e: e.run(plan__file=_saved_plan(
             e, lambda r: _train_alloc(r)["layout"].update(dp=4))), 2,
         ("plan.file", "tp*pp*dp = 4 but the mesh has 2")),
    Case("micro_batches 0 in a saved plan",
         lambda e: e.run(plan__file=_saved_plan(
             e, lambda r: _train_alloc(r).update(micro_batches=0))), 2,
         ("plan.file", "micro_batches")),
    Case("a binary file as the saved plan",
         lambda e: e.run(plan__file=e.write("plan.bin", bytes(range(256)))), 2,
         ("plan.file", "is not a readable plan file")),
    Case("a saved plan whose MFC names are not the experiment's",
         lambda e: e.run(plan__file=_saved_plan(
             e, lambda r: _train_alloc(r).update(mfc="actor.learn"))), 2,
         ("plan.file", "allocations are for")),
    # ---- reward functions (found on the first batch, while running) -------------------
    Case("a reward function returning a string",
         lambda e: e.run(reward__fn=f"{e.write('bad_reward.py', REWARDS)}:text"), 1,
         ("reward.fn", "returned 'abc' (str)", "step 0")),
    Case("a reward function returning None",
         lambda e: e.run(reward__fn=f"{e.write('bad_reward.py', REWARDS)}:nothing"), 1,
         ("reward.fn", "returned None")),
    Case("a NaN reward",
         lambda e: e.run(reward__fn=f"{e.write('bad_reward.py', REWARDS)}:nan"), 1,
         ("reward.fn", "returned nan", "step 0", "non-finite"),
         then=lambda e: _nothing_saved(e.run_dir)),
]


def _nothing_saved(run_dir: Path) -> None:
    assert not (run_dir / "final").exists()
    assert not list(run_dir.glob("checkpoints/step_*"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tiny_assets, tmp_path, capsys):
    from realign.cli.main import main

    env = Env(tiny_assets, tmp_path)
    argv = case.make(env)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    text = out + err
    assert code == case.exit, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for words in case.says:
        assert words in text, (words, text[-3000:])
    if case.exit == 2:
        assert not (env.run_dir / "logs").exists(), "no worker may start on bad input"
    if case.then is not None:
        case.then(env)


# ---- damaged run folders -------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tiny_assets, tmp_path_factory) -> tuple[Path, str]:
    """A finished 4-step run with checkpoints after steps 2 and 4."""
    from realign.cli.main import main

    tmp = tmp_path_factory.mktemp("finished")
    exp = str(experiment(tiny_assets, "tiny-grpo-cpu", tmp, run__steps=4,
                         run__checkpoint_interval=2))
    assert main(["run", exp, "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run", exp


def _copy(finished_run, tmp_path) -> Path:
    rd = tmp_path / "run"
    shutil.copytree(finished_run[0], rd)
    return rd


def _rerun(finished_run, rd: Path, capsys, *extra) -> tuple[int, str]:
    from realign.cli.main import main

    capsys.readouterr()
    code = main(["run", finished_run[1], "--run-dir", str(rd), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    return code, out + err


def _weights(folder: Path) -> dict:
    """The tensors of a HF folder, read into memory (not mapped: the test damages files)."""
    from safetensors.torch import load
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load(f.read_bytes()))
    return out


def test_a_damaged_final_model_is_written_again(finished_run, tmp_path, capsys):
    import torch

    rd = _copy(finished_run, tmp_path)
    want = _weights(rd / "final" / "actor")
    shard = next((rd / "final" / "actor").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])          # a kill during the final save
    (rd / "final" / "actor" / "tokenizer.json").unlink()
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "writing it again" in text
    got = _weights(rd / "final" / "actor")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (rd / "final" / "actor" / "tokenizer.json").is_file()
    assert (rd / "final" / "actor.damaged").is_dir()      # set aside, not deleted
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "already finished" in text


def test_a_truncated_newest_checkpoint_falls_back_and_is_kept(finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "final")
    newest = rd / "checkpoints" / "step_000004" / "rank1.pt"
    newest.write_bytes(newest.read_bytes()[:50])
    # a user's backup copy and a cut-off metrics line must not trouble the resume
    shutil.copytree(rd / "checkpoints" / "step_000002", rd / "checkpoints" / "step_000002.bak")
    with open(rd / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0, text[-3000:]
    assert "step_000004 is damaged" in text and "rank1.pt" in text
    assert "resuming from" in text and "step_000002" in text
    assert (rd / "checkpoints" / "step_000004.damaged").is_dir()
    assert (rd / "checkpoints" / "step_000002.bak").is_dir()
    rows = metrics(rd)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (rd / "final" / "actor" / "config.json").is_file()


def test_no_intact_checkpoint_is_an_input_error_naming_the_files(finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    for step in ("step_000002", "step_000004"):
        (rd / "checkpoints" / step / "rank0.pt").unlink()
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 2 and "no intact checkpoint" in text and "rank0.pt is missing" in text
    # an exit-2 refusal changes nothing on disk: no checkpoint is renamed or removed
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step_000002",
                                                                      "step_000004"]
    assert "Nothing was changed" in text


def test_a_damaged_metrics_line_is_restored_from_its_checkpoint(finished_run, tmp_path, capsys):
    """The last step's metrics line is damaged but the checkpoint after it is intact:
    the rerun restores the line from the checkpoint (each checkpoint keeps the lines of
    the steps it covers), so metrics.jsonl has every step exactly once."""
    rd = _copy(finished_run, tmp_path)
    want = (rd / "metrics.jsonl").read_text().splitlines()
    damaged = want[:3] + [want[3][:20]]                    # step 3's line cut off
    (rd / "metrics.jsonl").write_text("\n".join(damaged) + "\n")
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "already finished" in text, text[-3000:]
    assert "restored the metrics of step 3 from checkpoint step_000004" in text
    assert (rd / "metrics.jsonl").read_text().splitlines() == want
    # a line missing in the middle comes back too, in step order, and a resumed run
    # (the final model written again) keeps every step exactly once
    (rd / "metrics.jsonl").write_text("\n".join(want[:1] + want[2:] + want[3:]) + "\n")
    shutil.rmtree(rd / "final")
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "restored the metrics of step 1 from checkpoint step_000002" in text
    assert (rd / "metrics.jsonl").read_text().splitlines() == want


def test_a_checkpoint_of_another_optimizer_sharding_is_refused_before_workers(
        finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "final")
    shutil.rmtree(rd / "logs")
    exp = yaml.safe_load(Path(finished_run[1]).read_text())
    exp["train"]["distributed_optimizer"] = True
    other = Path(finished_run[1]).with_name(f"{tmp_path.name}-zero1.yaml")   # beside its assets
    other.write_text(yaml.safe_dump(exp))
    from realign.cli.main import main
    capsys.readouterr()
    code = main(["run", str(other), "--run-dir", str(rd)])
    text = "".join(capsys.readouterr())
    assert code == 2 and "train.distributed_optimizer: false" in text
    assert "Traceback" not in text and not (rd / "logs").exists()


@pytest.mark.parametrize("name,make", [
    ("checkpoints", lambda p: p.write_text("x")), ("final", lambda p: p.write_text("x")),
    ("tensorboard", lambda p: p.write_text("x")), ("metrics.jsonl", lambda p: p.mkdir())])
def test_a_run_folder_entry_of_the_wrong_kind_is_left_alone(finished_run, tmp_path, capsys,
                                                           name, make):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "logs")
    target = rd / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    make(target)
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 2 and f"{target} is a" in text and "move it away" in text
    assert not (rd / "logs").exists()


def test_a_damaged_job_index_entry(tmp_path, monkeypatch, capsys):
    from realign.cli.main import main

    monkeypatch.setenv("REALIGN_HOME", str(tmp_path))
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "local-7.json").write_text('{"backend": "local", "job_')
    assert main(["status", "local-7"]) == 2
    err = capsys.readouterr().err
    assert "JOB" in err and "local-7.json is damaged" in err and "Traceback" not in err
