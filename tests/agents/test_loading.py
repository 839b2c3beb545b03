"""Environments and tools named in the YAML that exit while being loaded: a
constructor or a module that calls ``sys.exit`` is a UserError naming the field
(exit 2 before any worker starts), not an exit of the process with the code it chose."""
from __future__ import annotations

import pytest

from realign.agents.config import MultiTurn
from realign.agents.loading import env_factory
from realign.agents.observation import observation_chars
from realign.errors import UserError
from realign.paths import YAML_DIR

pytestmark = pytest.mark.pure

ENVS = '''
import sys

class QuitsAtBirth:
    def __init__(self):
        sys.exit(0)
    def reset(self, episode):
        return ""
    def step(self, turn):
        return ("", 0.0, True)

class Interrupted:
    def __init__(self):
        raise KeyboardInterrupt
    def reset(self, episode):
        return ""
    def step(self, turn):
        return ("", 0.0, True)
'''

CLI_TOOLS = '''
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
args = parser.parse_args([])

def add(a: int, b: int) -> str:
    return str(a + b)
'''


def _in(folder, **fields) -> MultiTurn:
    """The rollout keys ``fields`` as an experiment YAML in ``folder`` gives them."""
    return MultiTurn.model_validate(fields, context={YAML_DIR: folder})


@pytest.mark.parametrize("cls, shown", [("QuitsAtBirth", "raised SystemExit: 0"),
                                        ("Interrupted", "raised KeyboardInterrupt")])
def test_a_constructor_that_exits_is_a_user_error(tmp_path, cls, shown):
    (tmp_path / "envs.py").write_text(ENVS)
    with pytest.raises(UserError, match=shown) as e:
        env_factory(_in(tmp_path, env=f"envs.py:{cls}"))
    assert e.value.field == "rollout.env"


def test_a_module_that_exits_while_importing_is_a_user_error(tmp_path):
    (tmp_path / "cli_tools.py").write_text(CLI_TOOLS)
    with pytest.raises(UserError, match=r"importing \S+/cli_tools.py:add called sys.exit\(2\)"
                       ) as e:
        env_factory(_in(tmp_path, tools=["cli_tools.py:add"]))
    assert e.value.field == "rollout.tools[0]"


def test_the_tool_environment_reads_answers_up_to_the_observation_bound(tmp_path):
    (tmp_path / "tools.py").write_text("def add(a: int, b: int) -> str:\n"
                                       "    return str(a + b)\n")
    env = env_factory(_in(tmp_path, tools=["tools.py:add"], max_observation_tokens=8))()
    assert env.max_result_chars == observation_chars(8) == 8 * 256 + 256
