"""A huge observation is cut before it is tokenized, to the very tokens a whole
tokenization gives: a 10 MB tool answer gives the observation its first part alone
gives, and the tokenizer (a byte-level BPE trained here) never sees more than
:func:`~realign.agents.observation.observation_chars` characters."""
from __future__ import annotations

import random

import pytest

from realign.agents.config import MultiTurn
from realign.agents.interface import Episode, Step
from realign.agents.observation import cut_observation, observation_chars
from realign.agents.rollout import EpisodeLoop
from realign.agents.tool_calls import format_call
from realign.agents.tool_env import ToolEnvironment
from realign.agents.tools import as_tool

pytestmark = pytest.mark.torch

N = 64                                   # max_observation_tokens
BOUND = observation_chars(N)


def words_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(1, 9)))
             for _ in range(300)] + ["\n", "12345", "<b>", "---"]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([words_text(60, i) for i in range(300)]
                            + ["abcdefghij" * 20] * 20, trainer)
    return tok


class Recorder:
    """The tokenizer's encode, recording the length of every text it is given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def observation_of(tok, answer: str) -> tuple[list[int], list[int], float]:
    """(the observation's tokens in the context, the lengths encode saw, the
    truncated_observations count) of one episode whose tool answers ``answer``."""
    def fetch(url: str) -> str:
        return answer

    rec = Recorder(tok)
    tools = {"fetch": as_tool(fetch, "m:fetch")}
    cfg = MultiTurn(tools=["m:fetch"], max_turns=2, max_observation_tokens=N, env_groups=1)
    call = rec.encode(format_call("fetch", {"url": "x"}))
    rec.lengths.clear()

    def generate(contexts, max_new, i):
        return [(call, [-0.5] * len(call)) if i == 0 else ([7], [-0.5]) for _ in contexts]

    loop = EpisodeLoop(cfg, lambda: ToolEnvironment(tools, 5.0, 0.0, BOUND), rec.encode,
                       rec.decode, budget=10_000, max_context=100_000)
    states = loop.run([[1, 2]], [Episode("Q", None, 0)], generate)
    s = states[0]
    obs = [t for t, model in zip(s.response, s.is_model) if not model]
    return obs, rec.lengths, loop.metrics(states)["rollout.truncated_observations"]


def test_a_10_mb_answer_gives_the_tokens_of_its_normal_sized_start(tokenizer):
    normal = words_text(800, seed=1)                          # ~4,000 characters
    filler = " " + words_text(2_000, seed=2)
    huge = (normal + filler * (10_000_000 // len(filler) + 1))[:10_000_000]
    assert len(normal) < BOUND and len(huge) == 10_000_000
    got_normal, seen_normal, cut_normal = observation_of(tokenizer, normal)
    got_huge, seen_huge, cut_huge = observation_of(tokenizer, huge)
    # a normal answer: tokenized whole and cut, as it always was
    whole = tokenizer.encode("<tool_response>" + normal + "</tool_response>").ids
    assert len(whole) > N and got_normal == whole[:N] and cut_normal == 1
    assert got_huge == got_normal and cut_huge == 1
    assert max(seen_huge) == BOUND and max(seen_normal) < BOUND


@pytest.mark.parametrize("text", [
    words_text(20_000, seed=3),                                  # words, ~100,000 characters
    "abcdefghij" * 10_000,                                       # one 100,000-character word
    "\n\n" + " " * 50_000 + words_text(10_000, seed=4),          # a long run of spaces first
])
def test_the_character_cut_gives_the_tokens_of_a_whole_tokenization(tokenizer, text):
    """Texts well past the bound, tokenized whole here (the old way) to compare."""
    rec = Recorder(tokenizer)
    ids, cut = cut_observation(text, rec.encode, N)
    assert ids == tokenizer.encode(text).ids[:N] and cut
    assert rec.lengths == [BOUND]


def test_an_environment_observation_is_cut_the_same_way(tokenizer):
    text = words_text(50_000, seed=5)

    class Talks:
        def reset(self, episode):
            return text

        def step(self, turn):
            return Step("", 0.0, True)

    rec = Recorder(tokenizer)
    cfg = MultiTurn(env="m:Talks", max_turns=1, max_observation_tokens=N, env_groups=1)
    loop = EpisodeLoop(cfg, Talks, rec.encode, rec.decode, budget=1000, max_context=10_000)
    states = loop.run([[1]], [Episode("Q", None, 0)],
                      lambda contexts, n, i: [([7], [-0.5]) for _ in contexts])
    assert states[0].response[:N] == tokenizer.encode(text).ids[:N]
    assert max(rec.lengths) == BOUND
    assert loop.metrics(states)["rollout.truncated_observations"] == 1
