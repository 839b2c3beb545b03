"""Tool calls of a batch run together: 16 episodes, a tool that sleeps 50 ms, 3 tool
turns per episode, a scripted generator (no model: the study is of the environment's
time). Prints, per round and group count, the seconds the loop waited for tools per
turn, against 16 x 50 ms = 0.8 s in series. Command:
``.venv/bin/python -m realign.bench.studies.tools_concurrency [rounds]``."""
from __future__ import annotations

import json
import statistics
import sys
import time

from realign.agents.config import MultiTurn
from realign.agents.interface import Episode
from realign.agents.rollout import EpisodeLoop
from realign.agents.tool_calls import format_call
from realign.agents.tool_env import ToolEnvironment
from realign.agents.tools import as_tool


def nap(s: float) -> str:
    time.sleep(s)
    return "done"


def one(groups: int, decode_s: float) -> dict:
    call = format_call("nap", {"s": 0.05})
    turns = {0: call, 1: call, 2: call, 3: "end"}

    def generate(contexts, max_new, idx):
        time.sleep(decode_s)                     # a stand-in for decoding the group
        out = []
        for c in contexts:
            text = turns["".join(map(chr, c)).count("<tool_response>")]
            out.append(([ord(x) for x in text], [0.0] * len(text)))
        return out

    tools = {"nap": as_tool(nap, "nap")}
    loop = EpisodeLoop(MultiTurn(tools=["nap"], max_turns=4, env_groups=groups),
                   lambda: ToolEnvironment(tools, 5.0), lambda s: [ord(x) for x in s],
                   lambda ids: "".join(map(chr, ids)), budget=10_000, max_context=100_000)
    t0 = time.monotonic()
    states = loop.run([[ord("Q")]] * 16, [Episode("Q", None, i) for i in range(16)], generate)
    wall = time.monotonic() - t0
    m = loop.metrics(states)
    return {"groups": groups, "decode_s": decode_s, "wall_s": wall,
            "env_wait_per_turn_s": m["rollout.env_wait_s"] / 3,
            "env_s_per_call": m["rollout.env_s"] / m["rollout.tool_calls"],
            "tool_calls": m["rollout.tool_calls"]}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    results = [one(g, d) for _ in range(rounds) for g, d in ((1, 0.0), (2, 0.05))]
    for r in results:
        print(json.dumps(r))
    for g, d in ((1, 0.0), (2, 0.05)):
        waits = [r["env_wait_per_turn_s"] for r in results if r["groups"] == g]
        print(f"groups {g}, decode {d} s: wait per turn median {statistics.median(waits):.4f} s,"
              f" min {min(waits):.4f}, max {max(waits):.4f} (serial: 0.8000 s)")


if __name__ == "__main__":
    main()
