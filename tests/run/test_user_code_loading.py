"""User code named in the YAML (rewards, environments, tools) loads through one loader,
:mod:`realign.usercode`: a module that exits while importing is a UserError naming the
field, and `realign run` exits 2 with it before any worker starts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from realign.errors import UserError
from realign.rewards.registry import load_reward_fn
from realign.usercode import import_object
from tests.run.conftest import experiment

REALIGN = [sys.executable, "-m", "realign.cli.main"]

EXITS = "import sys\nsys.exit(3)\ndef shaped(prompt, response, answer):\n    return 0.0\n"
ARGPARSE = ("import argparse\np = argparse.ArgumentParser()\n"
            "p.add_argument('--model', required=True)\np.parse_args([])\n"
            "def f(prompt, response, answer):\n    return 0.0\n")


@pytest.mark.pure
@pytest.mark.parametrize("source, shown", [
    (EXITS, r"importing \S+/exits\.py:shaped called sys\.exit\(3\)"),
    (ARGPARSE, r"importing \S+/exits\.py:shaped called sys\.exit\(2\)"),
    ("raise GeneratorExit('gone')\n", r"importing \S+/exits\.py:shaped raised GeneratorExit: gone"),
    ("raise RuntimeError('boom')\n", r"importing '.*exits\.py' raised RuntimeError: boom"),
])
def test_a_reward_file_that_leaves_its_import_is_a_user_error(tmp_path, source, shown):
    (tmp_path / "exits.py").write_text(source)
    with pytest.raises(UserError, match=shown) as e:
        load_reward_fn(f"{tmp_path}/exits.py:shaped")
    assert e.value.field == "reward.fn"
    assert "Traceback" not in str(e.value)


@pytest.mark.pure
def test_a_module_on_the_path_that_exits_names_its_field(tmp_path, monkeypatch):
    (tmp_path / "quitting_module_xyz.py").write_text(EXITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"quitting_module_xyz:shaped called sys\.exit\(3\)"
                       ) as e:
        import_object("quitting_module_xyz:shaped", "eval.verifier")
    assert e.value.field == "eval.verifier"
    assert "quitting_module_xyz" not in sys.modules    # a failed import leaves nothing behind


@pytest.mark.pure
def test_a_keyboard_interrupt_while_importing_propagates(tmp_path):
    """In the main thread a KeyboardInterrupt may be the user's Ctrl-C: not a UserError."""
    (tmp_path / "ctrl_c.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        import_object(f"{tmp_path}/ctrl_c.py:f", "reward.fn")


@pytest.mark.pure
def test_a_file_that_exited_is_imported_again_once_fixed(tmp_path):
    path = tmp_path / "fixed_later.py"
    path.write_text(EXITS)
    with pytest.raises(UserError):
        import_object(f"{path}:shaped", "reward.fn")
    path.write_text("def shaped(prompt, response, answer):\n    return 1.5\n")
    assert import_object(f"{path}:shaped", "reward.fn")("p", "r", "a") == 1.5


@pytest.mark.pure
def test_run_exits_2_naming_reward_fn_for_a_reward_module_that_exits(tiny_assets, tmp_path):
    (tiny_assets / "exiting_reward.py").write_text(EXITS)
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path,
                     reward__fn="exiting_reward.py:shaped")
    r = subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "reward.fn" in r.stderr and "called sys.exit(3)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "logs").exists(), "no worker may start on bad input"
