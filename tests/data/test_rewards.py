"""The math verifier and loading reward functions by name."""
from __future__ import annotations

import pytest

from realign.errors import UserError
from realign.rewards.math import FORMAT_CREDIT, math_verify, math_verify_format, numbers
from realign.rewards.registry import BUILTINS, load_reward_fn

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("response,answer,score", [
    ("7", "7", 1.0), (" 7</s>", "7", 1.0), ("the answer is 12.", "12", 1.0),
    ("3+4=7", "7", 1.0), ("7.0", "7", 1.0), ("1,000", "1000", 1.0), ("-3", "-3", 1.0),
    ("x = -3", -3, 1.0), ("13", 13, 1.0), ("7 or maybe 8", "7", 0.0), ("8", "7", 0.0),
    ("", "7", 0.0), ("seven", "7", 0.0), ("17", "7", 0.0), ("3-4", "-4", 0.0),
    ("3-4", "4", 1.0), ("so 9", "\\boxed{9}", 1.0),
])
def test_math_verify(response, answer, score):
    assert math_verify("3+4=", response, answer) == score


def test_numbers():
    assert [str(x) for x in numbers("3-4 is -1.50, not 2,500")] == ["3", "4", "-1.50", "2500"]


def test_format_credit():
    assert math_verify_format("p", "7", "7") == 1.0
    assert math_verify_format("p", " 8 ", "7") == FORMAT_CREDIT       # a bare wrong number
    assert math_verify_format("p", "8 apples", "7") == 0.0
    assert math_verify_format("p", "", "7") == 0.0


def test_reference_without_a_number():
    with pytest.raises(UserError, match="holds no number"):
        math_verify("p", "7", "seven")


def test_builtins():
    assert load_reward_fn("math_verify") is math_verify
    assert load_reward_fn(" math_verify_format ") is math_verify_format
    assert set(BUILTINS) == {"math_verify", "math_verify_format"}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompt, response, answer):\n    return float(len(response))\n"
        "def two_args(prompt, response):\n    return 0.0\n"
        "class Scorer:\n    @staticmethod\n    def score(prompt, response, answer=None):\n"
        "        return 1.0\n"
        "THRESHOLD = 3\n")
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency_xyz\n")
    (tmp_path / "raising_rewards.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_user_function(user_module):
    fn = load_reward_fn("my_rewards:length_reward")
    assert fn("p", "abc", None) == 3.0
    assert load_reward_fn("my_rewards:Scorer.score")("p", "r", "a") == 1.0
    from realign.config.experiment import RewardConfig
    from realign.paths import YAML_DIR

    named = RewardConfig.model_validate({"fn": "my_rewards.py:length_reward"},
                                        context={YAML_DIR: user_module})   # as a YAML there
    assert named.fn == f"{user_module / 'my_rewards.py'}:length_reward"
    by_file = load_reward_fn(named.fn)
    assert by_file("p", "ab", None) == 2.0
    assert load_reward_fn(str(user_module / "my_rewards.py") + ":length_reward") is not None


@pytest.mark.parametrize("spec,match", [
    ("", "built-in name or 'module:function'"),
    ("math_verifyy", "unknown reward 'math_verifyy'.*math_verify"),
    ("my_rewards:", "malformed"), (":length_reward", "malformed"), ("a:b:c", "malformed"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'.*PYTHONPATH"),
    ("no_such_pkg_xyz.sub:f", "no module named"),
    ("broken_rewards:f", "importing 'broken_rewards' failed.*not_a_real_dependency_xyz"),
    ("raising_rewards:f", "raised RuntimeError: boom"),
    ("my_rewards:nope", "has no attribute 'nope'.*length_reward"),
    ("my_rewards:Scorer.nope", "my_rewards:Scorer has no attribute 'nope'"),
    ("my_rewards:THRESHOLD", "int, not a function"),
    ("my_rewards:two_args", r"must accept \(prompt, response, answer\)"),
    ("missing_file.py:f", "no such file"),
])
def test_load_errors(user_module, spec, match):
    with pytest.raises(UserError, match=match) as e:
        load_reward_fn(spec, field="reward.fn")
    assert e.value.field == "reward.fn"


def test_non_string_spec():
    with pytest.raises(UserError):
        load_reward_fn(None)
