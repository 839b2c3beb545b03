"""Multi-turn episodes (``realign.agents``) on vLLM against realign's own engine, in a
one-rank gloo world in this process (vLLM's engine core in its child): with greedy
turns and a deterministic environment both engines give the same records (tokens,
lengths, observation masks; log-probs fp32 rounding apart), and every masked span of a
response is exactly an observation the environment wrote; with the built-in tool
environment (``rollout.tools``) and sampled turns on vLLM, a turn ends at its
``</tool_call>``, each answered turn holds a call, and every answer is in the record
as ``<tool_response>...</tool_response>`` (cut only where the episode's token
budget ends), masked, with log-prob 0."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

TEXTS = ["123+456=", "250+250=", "901+99=", "314+159=", "777+111=", "100+900="]
BUDGET = 40          # response tokens of an episode
TURN = 8             # tokens of a model turn


@pytest.fixture(scope="module")
def actor(world, tiny_assets):
    """(shard, tokenizer, folder) of the tool task's actor (the tool tokenizer: its tags
    are one token each; heads of 32 channels), fp32, TP 1."""
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.data.tokenizer import load_tokenizer
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    folder = tiny_assets / "tiny" / "tool_actor"
    spec = spec_from_hf(folder)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1),
                                  Layout(tp=1, pp=1, dp=1))
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"),
                        init_weights=False)
    load_hf_weights(shard, folder)
    return shard, load_tokenizer(folder), folder


@pytest.fixture(scope="module")
def vllm(actor):
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    shard, tok, folder = actor
    prompt_len = max(len(tok.encode(t, add_special_tokens=False)) for t in TEXTS)
    e = VLLMEngine(folder, VLLMSettings(kv_cache_gib=1, max_num_seqs=64), torch.float32,
                   max_model_len=prompt_len + BUDGET)
    e.load(shard)
    yield e
    e.close()


class Echo:
    """Answers each turn with its length in tool-response tags; ends after two turns.
    Every observation it writes is logged per episode."""

    def __init__(self, log: dict[int, list[str]]):
        self.log = log

    def reset(self, episode):
        self.index, self.turns = episode.index, 0
        self.log[self.index] = []
        return ""

    def step(self, turn):
        self.turns += 1
        obs = f"<tool_response>{len(turn)}</tool_response>"
        if self.turns < 2:
            self.log[self.index].append(obs)
        return obs, float(len(turn) % 2 == 0), self.turns >= 2


def episodes(actor, engine, make_env, cfg, params, samples=2):
    from realign.worker.episodes import generate_episodes, stop_ids

    shard, tok, _ = actor
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS for _ in range(samples)]
    p = params.model_copy(update={"stop_token_ids": stop_ids(tok, tok.eos_token_id)})
    return generate_episodes(cfg, make_env, tok, prompts,
                             {"texts": TEXTS, "answers": [None] * len(TEXTS)}, engine, p,
                             1, BUDGET, shard.spec.max_seq_len, 0, "rollout.")


def own_engine(shard):
    from realign.runtime.engines.generate import GenerateEngine

    return lambda rows, p: GenerateEngine(shard, pad_id=0).generate(rows, p)


def vllm_engine(shard, vllm):
    return lambda rows, p: vllm.generate(shard, rows, p, pad_id=0)


def masked_spans(seqs, i) -> list[list[int]]:
    """The runs of response tokens of row ``i`` whose log-prob position is masked."""
    p, n = int(seqs["prompt_lengths"][i]), int(seqs["lengths"][i])
    mask = seqs["action_mask"][i]
    spans: list[list[int]] = []
    prev = True
    for t in range(p, n):
        if mask[t - 1] == 0:
            if prev:
                spans.append([])
            spans[-1].append(int(seqs["tokens"][i, t]))
        prev = bool(mask[t - 1] != 0)
    return spans


def test_greedy_episodes_equal_the_own_engines_and_mask_the_observations(actor, vllm):
    from realign.agents.config import MultiTurn
    from realign.runtime.settings import SamplingParams

    shard, tok, _ = actor
    cfg = MultiTurn(env="echo:Echo", max_turns=3, turn_tokens=TURN, env_groups=2)
    greedy = SamplingParams(greedy=True)
    logs: dict[str, dict[int, list[str]]] = {"own": {}, "vllm": {}}
    own = episodes(actor, own_engine(shard), lambda: Echo(logs["own"]), cfg, greedy)
    got = episodes(actor, vllm_engine(shard, vllm), lambda: Echo(logs["vllm"]), cfg, greedy)
    (a, alp, am), (b, blp, bm) = own, got
    for key in ("tokens", "lengths", "prompt_lengths", "action_mask", "answer_start", "turns"):
        assert torch.equal(a[key], b[key]), key
    assert torch.allclose(alp["logprobs"], blp["logprobs"], atol=1e-5)
    assert logs["own"] == logs["vllm"]
    assert b["turns"].tolist() == [2] * len(b["turns"])       # the environment ends each
    assert 0.0 < bm["rollout.masked_share"] < 1.0
    assert bm["rollout.masked_share"] == am["rollout.masked_share"]
    for i in range(len(b["turns"])):
        # the masked tokens are the observation, token for token, and nothing else
        assert masked_spans(b, i) == [tok.encode(o, add_special_tokens=False)
                                      for o in logs["vllm"][i]]
        model = b["action_mask"][i] == 1
        assert bool((blp["logprobs"][i][model] <= 0).all())
        assert float(blp["logprobs"][i][~model].abs().sum()) == 0.0
    assert int(b["action_mask"].sum()) == bm["rollout.model_tokens"]


def test_sampled_tool_calls_end_their_turn_and_their_answers_are_masked(actor, vllm):
    from realign.agents.config import MultiTurn
    from realign.agents.tool_calls import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
    from realign.agents.tool_env import ToolEnvironment
    from realign.agents.tools import as_tool
    from realign.assets.tiny_tools import add
    from realign.runtime.settings import SamplingParams

    shard, tok, _ = actor
    close = tok.get_vocab()[CALL_CLOSE]
    tool = as_tool(add, "add")
    cfg = MultiTurn(tools=["realign.assets.tiny_tools:add"], max_turns=3, turn_tokens=TURN)
    calls = 0
    for seed in range(4):
        seqs, lps, m = episodes(
            actor, vllm_engine(shard, vllm),
            lambda: ToolEnvironment({tool.name: tool}, timeout_s=5.0), cfg,
            SamplingParams(temperature=1.0, seed=seed), samples=8)
        calls += m["rollout.tool_calls"]
        assert m["rollout.env_errors"] == 0.0
        for i in range(len(seqs["turns"])):
            p, n = int(seqs["prompt_lengths"][i]), int(seqs["lengths"][i])
            mask = seqs["action_mask"][i]
            turns = [[]]                   # the model's turns, split by observations
            for t in range(p, n):
                if mask[t - 1] == 1:
                    turns[-1].append(int(seqs["tokens"][i, t]))
                elif turns[-1]:
                    turns.append([])
            spans = masked_spans(seqs, i)
            for k, span in enumerate(spans):
                text = tok.decode(span)
                assert text.startswith(RESPONSE_OPEN)
                # whole, or cut where the episode's token budget ends
                assert text.endswith(RESPONSE_CLOSE) or (k == len(spans) - 1
                                                         and n - p == BUDGET)
            answered = len(spans)
            for k, turn in enumerate(t for t in turns if t):
                # a turn ends at the first </tool_call> it writes
                assert close not in turn[:-1]
                if k < answered:               # it was answered: it called a tool
                    assert CALL_OPEN in tok.decode(turn)
            assert float(lps["logprobs"][i][mask == 0].abs().sum()) == 0.0
    assert calls > 0          # the random actor writes <tool_call> now and then
