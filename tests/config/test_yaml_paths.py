"""Every path an experiment YAML names is absolute once it is loaded: resolved against
the YAML's folder while it is validated (:mod:`realign.paths`), whatever the current
directory, so nothing downstream joins a relative path again. A preset's name, a module
name and a built-in stay as written."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from realign.config.experiment import ExperimentConfig
from realign.errors import UserError
from realign.paths import YAML_DIR, named_paths
from realign.run.loading import load_experiment

pytestmark = pytest.mark.pure

#: field path -> (the value written in the YAML, the path it names under the YAML's folder)
RELATIVE = {
    "models.actor": ("ckpt/actor", "ckpt/actor"),
    "models.critic": ("ckpt/critic/config.json", "ckpt/critic/config.json"),
    "models.ref": ("../shared/ref", "../shared/ref"),
    "models.reward": ("ckpt/reward", "ckpt/reward"),
    "lora.actor.init_from": ("adapters/actor", "adapters/actor"),
    "plan.profile": ("profiles/cpu.json", "profiles/cpu.json"),
    "plan.lengths_from": ("runs/earlier", "runs/earlier"),
    "plan.file": ("plans/plan.json", "plans/plan.json"),
    "data.train.path": ("data/train.jsonl", "data/train.jsonl"),
    "eval.data.path": ("data/held.jsonl", "data/held.jsonl"),
    "eval.verifier": ("code/verify.py:correct", "code/verify.py"),
    "reward.fn": ("code/rewards.py:Scorer.score", "code/rewards.py"),
    "rollout.env": ("code/envs.py:Maze", "code/envs.py"),
    "rollout.tools[0]": ("code/tools.py:add", "code/tools.py"),
}


def experiment(values: dict[str, str]) -> dict:
    """A PPO experiment with every path field set from ``values`` (field path -> value)."""
    v = values.get
    return {
        "name": "paths", "device": "cpu",
        "models": {r: v(f"models.{r}") for r in ("actor", "critic", "ref", "reward")},
        "lora": {"actor": {"rank": 4, "init_from": v("lora.actor.init_from")}},
        "algorithm": {"name": "ppo", "prompts_per_step": 2, "prompt_len": 8, "gen_len": 8},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
        "plan": {"profile": v("plan.profile"), "lengths_from": v("plan.lengths_from"),
                 "file": v("plan.file")},
        "data": {"train": {"path": v("data.train.path"), "kind": "prompts"}},
        "eval": {"data": {"path": v("eval.data.path"), "kind": "prompts"},
                 "verifier": v("eval.verifier")},
        "reward": {"fn": v("reward.fn")},
        "rollout": {"env": v("rollout.env"), "tools": [v("rollout.tools[0]")]},
    }


def field(cfg: ExperimentConfig, path: str) -> str:
    """The value at ``path`` (``a.b``, ``a.b[0]``; a dict's key as a name)."""
    node: object = cfg
    for part in path.split("."):
        name, _, index = part.partition("[")
        node = node[name] if isinstance(node, dict) else getattr(node, name)
        if index:
            node = node[int(index.rstrip("]"))]
    assert isinstance(node, str)
    return node


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> tuple[ExperimentConfig, Path]:
    """The experiment loaded from ``<tmp>/exp/e.yaml`` by a relative name, the current
    directory elsewhere (``<tmp>/work``)."""
    root = tmp_path_factory.mktemp("paths")
    (root / "exp").mkdir()
    (root / "work").mkdir()
    (root / "exp" / "e.yaml").write_text(
        yaml.safe_dump(experiment({k: w for k, (w, _) in RELATIVE.items()})))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root / "work")
        cfg = load_experiment("../exp/e.yaml")
    return cfg, (root / "exp").resolve()


@pytest.mark.parametrize("path", sorted(RELATIVE))
def test_a_relative_path_is_absolute_against_the_yamls_folder(loaded, path):
    cfg, folder = loaded
    written, names = RELATIVE[path]
    got = field(cfg, path)
    attr = written.partition(":")[2]
    assert got == (f"{folder / names}:{attr}" if attr else str(folder / names))
    assert Path(got.partition(":")[0]).is_absolute()


def test_every_path_field_is_listed_and_named_paths_finds_them_all(loaded):
    """The parametrized fields are all the schema's path fields: named_paths, which walks
    the schema's path types, finds exactly these (and the files they name)."""
    cfg, folder = loaded
    assert named_paths(cfg) == {k: folder / names for k, (_, names) in RELATIVE.items()}


@pytest.mark.parametrize("path, value", [
    ("models.actor", "tiny-llama"),                  # a preset
    ("reward.fn", "math_verify"),                    # a built-in
    ("reward.fn", "pkg.rewards:score"),              # a module on sys.path
    ("rollout.tools[0]", "pkg.tools:add"),
    ("data.train.path", "/abs/train.jsonl"),         # absolute already
    ("plan.profile", "/abs/profile.json"),
])
def test_names_that_are_no_relative_path_stay_as_written(tmp_path, monkeypatch, path, value):
    values = {k: w for k, (w, _) in RELATIVE.items()} | {path: value}
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(experiment(values)))
    monkeypatch.chdir("/")
    assert field(load_experiment(tmp_path / "e.yaml"), path) == value


def test_a_saved_config_validates_to_the_same_paths_anywhere(loaded, tmp_path, monkeypatch):
    """A prepared run saves the config (run_spec.json): its paths are absolute, so reading
    it back elsewhere, or with another folder in the context, changes nothing."""
    cfg, _ = loaded
    monkeypatch.chdir(tmp_path)
    text = cfg.model_dump_json()
    assert ExperimentConfig.model_validate_json(text) == cfg
    assert ExperimentConfig.model_validate_json(text, context={YAML_DIR: tmp_path}) == cfg


def test_without_a_yaml_a_relative_path_is_the_current_directorys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = experiment({k: w for k, (w, _) in RELATIVE.items()})
    cfg = ExperimentConfig.model_validate(raw)
    assert cfg.data is not None and cfg.data.train.path == str(tmp_path / "data/train.jsonl")


def test_a_bad_path_field_is_still_named(tmp_path):
    values = {k: w for k, (w, _) in RELATIVE.items()}
    raw = experiment(values)
    raw["plan"]["profile"] = 3
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as e:
        load_experiment(tmp_path / "e.yaml")
    assert e.value.field == "plan.profile"
