"""The multi-turn loop with a scripted generator (no model): observations in the
context and out of the action mask, turns, budgets, failures of an environment (exits
and interrupts it raises included), and tool calls of a batch running concurrently
with each other and with decoding."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from realign.agents.config import MultiTurn
from realign.agents.interface import Episode, Step
from realign.agents.rollout import EpisodeLoop, episode_records
from realign.agents.tool_calls import format_call
from realign.agents.tool_env import ToolEnvironment
from realign.agents.tools import as_tool

pytestmark = pytest.mark.torch


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def scripted(turns: dict[int, str], decode_s: float = 0.0, calls: list | None = None):
    """A generator whose turn ``k`` of every episode is ``turns[k]`` (``k``: how many
    tool responses the context holds); log-prob of each token -0.5."""
    def generate(contexts, max_new, call):
        if calls is not None:
            calls.append(len(contexts))
        time.sleep(decode_s)
        out = []
        for c in contexts:
            text = turns[dec(c).count("<tool_response>")][:max_new]
            out.append((enc(text), [-0.5] * len(text)))
        return out
    return generate


def add(a: int, b: int) -> str:
    return str(a + b)


def nap(s: float) -> str:
    time.sleep(s)
    return "done"


def episodes(n):
    return [Episode(prompt=f"p{i}", answer=None, index=i) for i in range(n)]


def tools_env(*fns, timeout_s=5.0):
    tools = {f.__name__: as_tool(f, f.__name__) for f in fns}
    return lambda: ToolEnvironment(tools, timeout_s)


def test_observations_are_in_the_context_and_out_of_the_mask():
    call = format_call("add", {"a": 2, "b": 3})
    cfg = MultiTurn(tools=["m:add"], max_turns=4, env_groups=1)
    loop = EpisodeLoop(cfg, tools_env(add), enc, dec, budget=200, max_context=1000)
    states = loop.run([enc("Q:")], episodes(1), scripted({0: call, 1: "5!"}))
    seqs, lp = episode_records(states, pad_id=0)
    text = dec(seqs["tokens"][0].tolist())
    obs = "<tool_response>5</tool_response>"
    assert text == "Q:" + call + obs + "5!"
    assert seqs["turns"].tolist() == [2]
    p, nc, no = 2, len(call), len(obs)
    want = torch.zeros(len(text) - 1)
    want[p - 1:p - 1 + nc] = 1                    # position t scores token t + 1
    want[p - 1 + nc + no:] = 1
    assert torch.equal(seqs["action_mask"][0], want)
    assert torch.equal(lp["logprobs"][0], -0.5 * want)
    assert int(seqs["answer_start"][0]) == p + nc + no       # the final turn "5!"
    m = loop.metrics(states)
    assert m["rollout.turns"] == 2 and m["rollout.tool_calls"] == 1
    assert m["rollout.tool_call_rate"] == 1 and m["rollout.tool_errors"] == 0
    assert m["rollout.masked_share"] == pytest.approx(no / (nc + no + 2))
    assert m["rollout.turn1_reward"] == 0 and m["rollout.turn2_reward"] == 0


def test_turns_and_the_token_budget_bound_an_episode():
    call = format_call("add", {"a": 1, "b": 1})
    loops = {0: call, 1: call, 2: call, 3: call, 4: call}
    cfg = MultiTurn(tools=["m:add"], max_turns=3, env_groups=1)
    loop = EpisodeLoop(cfg, tools_env(add), enc, dec, budget=10_000, max_context=100_000)
    states = loop.run([enc("Q")], episodes(1), scripted(loops))
    assert states[0].turns == 3 and loop.metrics(states)["rollout.tool_calls"] == 3
    # a budget that ends inside the second call: the turn is cut, no step runs on it
    budget = len(call) + len("<tool_response>2</tool_response>") + 5
    loop = EpisodeLoop(cfg, tools_env(add), enc, dec, budget=budget, max_context=100_000)
    states = loop.run([enc("Q")], episodes(1), scripted(loops))
    seqs, _ = episode_records(states, 0)
    assert int(seqs["lengths"][0]) - 1 == budget and states[0].turns == 2
    assert loop.metrics(states)["rollout.tool_calls"] == 1


class Flaky:
    """An environment whose step fails as its episode's index says."""

    def reset(self, episode):
        self.i = episode.index
        return "<start>" if self.i == 0 else ""

    def step(self, turn):
        how = self.i % 6
        if how == 1:
            raise RuntimeError("broken")
        if how == 2:
            time.sleep(30)
        if how == 3:
            return (42, 1.0, False)
        if how == 4:
            return "not a tuple"
        if how == 5:
            return Step("x" * 500, 0.5, False)
        return Step("ok", 1.0, True)


def test_a_failing_environment_ends_its_episode_with_the_penalty_never_the_run():
    cfg = MultiTurn(env="m:Flaky", max_turns=2, tool_timeout_s=0.3, error_penalty=0.5,
                    max_observation_tokens=16, env_groups=1)
    loop = EpisodeLoop(cfg, Flaky, enc, dec, budget=300, max_context=1000)
    t0 = time.monotonic()
    states = loop.run([enc("Q")] * 6, episodes(6), scripted({0: "a", 1: "b"}))
    assert time.monotonic() - t0 < 10
    assert [s.turns for s in states] == [1, 1, 1, 1, 1, 2]
    assert [sum(s.turn_rewards) for s in states] == [1.0, -0.5, -0.5, -0.5, -0.5, 1.0]
    assert dec(states[0].response[:7]) == "<start>"          # reset's observation
    huge = dec(states[5].response)
    assert huge == "a" + "x" * 16 + "a"                       # cut to 16 tokens
    m = loop.metrics(states)
    assert m["rollout.env_errors"] == 4 and m["rollout.env_error.timeout"] == 1
    assert m["rollout.env_error.raised"] == 3 and m["rollout.truncated_observations"] == 1


@pytest.mark.parametrize("groups", [1, 2])
def test_sixteen_sleeping_tool_calls_run_together(groups):
    """16 episodes, a tool that sleeps 50 ms, 3 turns: in series one turn's calls would
    take 16 x 50 ms = 0.8 s; together about 50 ms. The bound is generous (half the
    serial time per turn) and about sleeps, not compute."""
    call = format_call("nap", {"s": 0.05})
    cfg = MultiTurn(tools=["m:nap"], max_turns=4, env_groups=groups)
    loop = EpisodeLoop(cfg, tools_env(nap), enc, dec, budget=10_000, max_context=100_000)
    calls: list = []
    states = loop.run([enc("Q")] * 16, episodes(16),
                      scripted({0: call, 1: call, 2: call, 3: "end"}, calls=calls))
    m = loop.metrics(states)
    assert m["rollout.tool_calls"] == 16 * 3
    assert m["rollout.env_s"] >= 16 * 3 * 0.05                 # every call slept
    per_turn = m["rollout.env_wait_s"] / 3
    assert per_turn < 16 * 0.05 / 2, per_turn
    assert calls == [16 // groups] * (4 * groups)


def test_a_group_decodes_while_the_other_groups_tools_run():
    """Two groups, a 0.2 s decode and a 0.1 s tool: each group's calls run during the
    other group's decode, so the loop hardly waits for tools at all."""
    call = format_call("nap", {"s": 0.1})
    turns = {0: call, 1: call, 2: "end"}
    waits = {}
    for groups in (1, 2):
        cfg = MultiTurn(tools=["m:nap"], max_turns=3, env_groups=groups)
        loop = EpisodeLoop(cfg, tools_env(nap), enc, dec, budget=10_000, max_context=100_000)
        states = loop.run([enc("Q")] * 8, episodes(8), scripted(turns, decode_s=0.2))
        waits[groups] = loop.metrics(states)["rollout.env_wait_s"]
    # two turns of calls waited for nearly in full (the loop starts waiting a moment
    # after the calls start)
    assert waits[1] >= 0.75 * 2 * 0.1
    assert waits[2] < waits[1] / 2, waits


def test_the_same_inputs_give_the_same_records():
    call = format_call("add", {"a": 4, "b": 5})
    runs = []
    for _ in range(2):
        cfg = MultiTurn(tools=["m:add"], max_turns=3, env_groups=2)
        loop = EpisodeLoop(cfg, tools_env(add), enc, dec, budget=300, max_context=1000)
        states = loop.run([enc("Q"), enc("QQ"), enc("R")], episodes(3),
                          scripted({0: call, 1: "9"}))
        runs.append(episode_records(states, 0))
    for k in runs[0][0]:
        assert torch.equal(runs[0][0][k], runs[1][0][k]), k


class Exits:
    """An environment that exits or interrupts in ``reset`` or ``step`` where its
    episode's index says; episode 0 behaves."""

    def reset(self, episode):
        self.how = {2: "reset:exit", 3: "reset:interrupt", 4: "step:exit",
                    5: "step:interrupt", 6: "step:generator_exit"}.get(episode.index, "")
        self._maybe("reset")
        return ""

    def step(self, turn):
        self._maybe("step")
        return Step("ok", 1.0, False)

    def _maybe(self, where: str) -> None:
        at, _, what = self.how.partition(":")
        if at != where:
            return
        if what == "exit":
            sys.exit(2)
        raise {"interrupt": KeyboardInterrupt, "generator_exit": GeneratorExit}[what]()


def test_an_environment_that_exits_or_interrupts_ends_its_episode_never_the_run():
    made = []

    def make_env():
        made.append(1)
        if len(made) == 2:                   # the second episode's constructor exits
            raise SystemExit(3)
        return Exits()

    cfg = MultiTurn(env="m:Exits", max_turns=2, error_penalty=0.5, env_groups=1)
    loop = EpisodeLoop(cfg, make_env, enc, dec, budget=300, max_context=1000)
    states = loop.run([enc("Q")] * 7, episodes(7), scripted({0: "a", 1: "b"}))
    # 0: two turns, each answered "ok" (1.0); 1-3 fail before the first turn, 4-6 at it
    assert [s.turns for s in states] == [2, 0, 0, 0, 1, 1, 1]
    assert [sum(s.turn_rewards) for s in states] == [2.0, 0, 0, 0, -0.5, -0.5, -0.5]
    assert dec(states[0].response) == "aoka"
    m = loop.metrics(states)
    assert m["rollout.env_errors"] == 6 and m["rollout.env_error.raised"] == 6


def test_a_real_sigint_while_the_loop_waits_still_interrupts():
    """A KeyboardInterrupt of the process's own (a SIGINT while the loop waits for a
    step) is not the environment's error: it propagates."""
    class Slow:
        def reset(self, episode):
            return ""

        def step(self, turn):
            time.sleep(5)
            return Step("late", 0.0, False)

    cfg = MultiTurn(env="m:Slow", max_turns=2, tool_timeout_s=20, env_groups=1)
    loop = EpisodeLoop(cfg, Slow, enc, dec, budget=300, max_context=1000)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            loop.run([enc("Q")], episodes(1), scripted({0: "a", 1: "b"}))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert loop.count.env_errors == 0
