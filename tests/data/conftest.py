"""Fixtures of the data tests: the tiny assets, built once per session, offline."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from realign.assets.tiny import make_tiny_assets

    return make_tiny_assets(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_assets):
    from realign.data.tokenizer import load_tokenizer

    return load_tokenizer(tiny_assets["actor"])


class CharTokenizer:
    """A torch-free stand-in with the tokenizer interface the loaders use: one id per
    character (ord + 10), ``<s>`` = 1 added as the first token, ``</s>`` = 2."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def __call__(self, texts, add_special_tokens=True):
        head = [self.bos_token_id] if add_special_tokens else []
        return {"input_ids": [head + [ord(c) + 10 for c in t] for t in texts]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


@pytest.fixture
def char_tok():
    return CharTokenizer()
