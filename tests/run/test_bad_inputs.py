"""Malformed inputs, as a new user gets them wrong: one table (damaged run folders:
``tests/run/test_damaged_run_folder.py``).

Each row makes an input (an experiment YAML, model files, a plan, a run folder) and
says what ``realign`` must do with it: the exit code (2: your input, refused before any
worker starts; 1: a failure while running) and words the message must hold. Every row
also checks that no traceback is printed and, for exit code 2, that no worker started.
Add a row to add a case.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests.run.conftest import experiment

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
