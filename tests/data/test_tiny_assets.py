"""The tiny assets: written offline, deterministic, loadable by transformers and by
the runtime's checkpoint reader; the arithmetic task is right."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from realign.assets.tiny import BOS_ID, EOS_ID, PAD_ID, WORDS, vocabulary


def _jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.mark.torch
def test_layout_and_offline_loading(tiny_assets):
    import torch
    import transformers as tf

    for role in ("actor", "reward", "qwen2_actor"):
        folder = tiny_assets[role]
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / f).is_file(), (role, f)
        tok = tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        assert len(tok) == len(vocabulary())
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tiny_assets["ref"] == tiny_assets["actor"]
    assert tiny_assets["critic"] == tiny_assets["reward"]

    ids = torch.tensor([[BOS_ID, 7, 15, 8, 19]])
    lm = tf.AutoModelForCausalLM.from_pretrained(str(tiny_assets["actor"]), local_files_only=True)
    assert type(lm).__name__ == "LlamaForCausalLM"
    assert lm(ids).logits.shape == (1, 5, len(vocabulary()))
    qwen = tf.AutoModelForCausalLM.from_pretrained(str(tiny_assets["qwen2_actor"]))
    assert type(qwen).__name__ == "Qwen2ForCausalLM"
    rm = tf.AutoModelForSequenceClassification.from_pretrained(str(tiny_assets["reward"]))
    assert type(rm).__name__ == "LlamaForSequenceClassification"
    assert rm(ids).logits.shape == (1, 1)
    base = tf.AutoModel.from_pretrained(str(tiny_assets["actor"]))
    assert base.config.hidden_size == 64


@pytest.mark.torch
def test_runtime_reads_the_checkpoints(tiny_assets):
    from realign.runtime.hf_checkpoint import spec_from_hf

    spec = spec_from_hf(tiny_assets["actor"])
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads) == (2, 64, 4, 2)
    assert spec.vocab_size == len(vocabulary())
    assert spec_from_hf(tiny_assets["qwen2_actor"]).qkv_bias


@pytest.mark.torch
def test_tokenizer_round_trip(tokenizer):
    ids = tokenizer("3+4=").input_ids
    assert ids[0] == BOS_ID and len(ids) == 5            # <s> 3 + 4 =
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3+4="
    assert tokenizer("12", add_special_tokens=False).input_ids == [
        tokenizer.convert_tokens_to_ids("1"), tokenizer.convert_tokens_to_ids("2")]
    for w in WORDS:
        assert len(tokenizer(w, add_special_tokens=False).input_ids) == 1, w
    text = "what is the answer?\nuser: 17 plus 5 equals 22."
    enc = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in enc
    assert tokenizer.decode(enc) == text
    assert tokenizer.decode(tokenizer("The Answer").input_ids, skip_special_tokens=True) == \
        "the answer"                                       # lower-cased
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s>user: 2+2=\nassistant: "


@pytest.mark.torch
def test_math_task(tiny_assets):
    train, evals = _jsonl(tiny_assets["math_train"]), _jsonl(tiny_assets["math_eval"])
    assert (len(train), len(evals)) == (80, 20)
    seen = set()
    for row in train + evals:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["prompt"] == f"{a}+{b}=" and row["answer"] == str(int(a) + int(b))
        seen.add(row["prompt"])
    assert len(seen) == 100                                # disjoint split, all pairs
    prefs = _jsonl(tiny_assets["prefs"])
    answers = {r["prompt"]: r["answer"] for r in train}
    assert len(prefs) == 80
    for p in prefs:
        assert p["chosen"] == answers[p["prompt"]] != p["rejected"]
        assert 0 <= int(p["rejected"]) <= 18
    sft = _jsonl(tiny_assets["sft"])
    assert all(r["response"] == answers[r["prompt"]] for r in sft)


@pytest.mark.torch
def test_deterministic_and_cli(tiny_assets, tmp_path, capsys):
    from realign.assets.tiny_cmd import main

    assert main([str(tmp_path), "--no-qwen2"]) == 0
    assert "math_train" in capsys.readouterr().out
    assert main([str(tmp_path / "x"), "--max-operand", "12"]) == 2
    assert "--max-operand" in capsys.readouterr().err
    assert not (tmp_path / "qwen2_actor").exists()
    root = Path(tiny_assets["actor"]).parent
    for rel in ("actor/model.safetensors", "actor/config.json", "actor/tokenizer.json",
                "reward/model.safetensors", "math_train.jsonl", "math_eval.jsonl",
                "prefs.jsonl", "sft.jsonl"):
        assert (tmp_path / rel).read_bytes() == (root / rel).read_bytes(), rel


@pytest.mark.pure
def test_other_seed_differs():
    from realign.assets.tiny import math_problems

    assert math_problems(0) != math_problems(1)
    assert math_problems(3) == math_problems(3)
    train, evals = math_problems(0, max_operand=4)
    assert (len(train), len(evals)) == (20, 5)
    assert max(int(r["answer"]) for r in train + evals) == 8


@pytest.mark.torch
def test_model_seed_is_local(tmp_path):
    """Building assets leaves the caller's torch RNG untouched."""
    import torch

    from realign.assets.tiny import build_tokenizer, make_model

    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    make_model(tmp_path / "m", seed=0, tokenizer=build_tokenizer())
    assert torch.equal(torch.rand(3), expect)
