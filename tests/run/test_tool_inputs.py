"""A broken environment or tool is exit 2 before any worker starts: a module that is
missing or raises on import, a class without reset/step or with the wrong signature,
a constructor that rejects rollout.env_args or raises, a function that cannot be a
tool, two tools of one name, rollout.env and rollout.tools together, a turn longer
than the episode's budget. Checked through prepare() (what `realign run` calls first)
and once through the command line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from realign.errors import UserError
from realign.run.prepare import prepare
from tests.run.conftest import experiment

pytestmark = pytest.mark.torch

ENVS = '''
class Good:
    def __init__(self, level=1):
        self.level = level
    def reset(self, episode):
        return ""
    def step(self, turn):
        return ("", 1.0, True)

class NoStep:
    def reset(self, episode):
        return ""

class WrongStep:
    def reset(self, episode):
        return ""
    def step(self):
        return ("", 0.0, True)

class Explodes(Good):
    def __init__(self):
        raise RuntimeError("no licence")

def star(*numbers):
    return sum(numbers)

def add(a: int, b: int) -> str:
    return str(a + b)

not_a_tool = 3
'''


@pytest.fixture
def envs(tiny_assets):
    (tiny_assets / "my_envs.py").write_text(ENVS)
    (tiny_assets / "broken_env.py").write_text("import not_a_real_module_xyz\n")
    return tiny_assets


CASES = [
    ({"rollout__env": "my_envs.py:Good", "rollout__env_args": {"level": 3}}, None, None),
    ({"rollout__env": "nowhere.py:Env"}, "rollout.env", "no such file"),
    ({"rollout__env": "broken_env.py:Env"}, "rollout.env", "ModuleNotFoundError"),
    ({"rollout__env": "my_envs.py:Missing"}, "rollout.env", "has no attribute 'Missing'"),
    ({"rollout__env": "my_envs.py:add"}, "rollout.env", "an environment is a class"),
    ({"rollout__env": "my_envs.py:NoStep"}, "rollout.env", "has no step() method"),
    ({"rollout__env": "my_envs.py:WrongStep"}, "rollout.env", "must take one argument"),
    ({"rollout__env": "my_envs.py:Good", "rollout__env_args": {"colour": 1}},
     "rollout.env_args", "does not take rollout.env_args"),
    ({"rollout__env": "my_envs.py:Explodes"}, "rollout.env", "raised RuntimeError: no licence"),
    ({"rollout__tools": ["my_envs.py:star"]}, "rollout.tools[0]", "parameters are named"),
    ({"rollout__tools": ["my_envs.py:not_a_tool"]}, "rollout.tools[0]", "is a int"),
    ({"rollout__tools": ["my_envs.py:add", "realign.assets.tiny_tools:add"]},
     "rollout.tools[1]", "two tools are named 'add'"),
    ({"rollout__tools": ["my_envs.py:add"], "rollout__env": "my_envs.py:Good"},
     "rollout.tools", "not both"),
    ({"rollout__tools": ["my_envs.py:add"], "rollout__turn_tokens": 57},
     "rollout.turn_tokens", "more than the episode's whole budget"),
]


@pytest.mark.parametrize("changes, field, says", CASES)
def test_environments_and_tools_are_checked_before_any_worker(envs, tmp_path, changes,
                                                              field, says):
    exp = experiment(envs, "tiny-tool-cpu", tmp_path, models__actor="tiny/tool_actor",
                     **{"rollout__tools": None, **changes})
    if field is None:
        spec = prepare(exp, run_dir=str(tmp_path / "run"))
        assert spec.config.rollout.env_args == {"level": 3}
        return
    with pytest.raises(UserError) as e:
        prepare(exp, run_dir=str(tmp_path / "run"))
    assert e.value.field == field, e.value
    assert says in e.value.message, e.value.message
    assert not (tmp_path / "run").exists()


def test_the_command_line_exits_2_naming_the_field(envs, tmp_path):
    exp = experiment(envs, "tiny-tool-cpu", tmp_path, models__actor="tiny/tool_actor",
                     rollout__tools=None, rollout__env="my_envs.py:WrongStep")
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rollout.env" in r.stderr and "must take one argument" in r.stderr
    assert "Traceback" not in r.stderr


def test_tools_without_any_generation_are_refused(envs, tmp_path):
    """SFT with tools and no eval section: nothing would ever call them."""
    exp = experiment(envs, "tiny-tool-sft-cpu", tmp_path, eval=None)
    with pytest.raises(UserError) as e:
        prepare(exp, run_dir=str(tmp_path / "run"))
    assert e.value.field == "rollout.tools" and "would never run" in e.value.message
    spec = prepare(experiment(envs, "tiny-tool-sft-cpu", tmp_path), run_dir=str(tmp_path / "r"))
    assert spec.config.rollout.tools == ["realign.assets.tiny_tools:add"]   # evaluations use them
