"""A tokenizer built from the class AutoTokenizer chose (``load_tokenizer``'s ``cls``, what
``realign run``'s workers do) is the tokenizer AutoTokenizer builds: same class, vocabulary,
special tokens, ids, text and chat template; and building it imports no model
configuration class (LLaMA's pulls transformers' activations and TorchDynamo)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from realign.data.tokenizer import load_tokenizer, tokenizer_class
from realign.errors import UserError

TEXTS = ["3+4=", "12 + 9 = 21", "what is 7*8?", "<s>a</s> b <pad>", ""]
FOLDERS = ["actor", "qwen2_actor", "llama31_actor", "qwen3_actor", "small_actor"]


@pytest.mark.torch
@pytest.mark.parametrize("role", FOLDERS)
def test_the_chosen_class_builds_autotokenizers_tokenizer(tiny_assets, role):
    auto = load_tokenizer(tiny_assets[role])
    name = tokenizer_class(auto)
    assert name == type(auto).__name__
    direct = load_tokenizer(tiny_assets[role], cls=name)
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab()
    assert ([direct.pad_token_id, direct.bos_token_id, direct.eos_token_id]
            == [auto.pad_token_id, auto.bos_token_id, auto.eos_token_id])
    assert direct.all_special_ids == auto.all_special_ids
    for special in (True, False):
        ids = direct(TEXTS, add_special_tokens=special)["input_ids"]
        assert ids == auto(TEXTS, add_special_tokens=special)["input_ids"]
        assert direct.batch_decode(ids) == auto.batch_decode(ids)
        assert (direct.batch_decode(ids, skip_special_tokens=True)
                == auto.batch_decode(ids, skip_special_tokens=True))
    chat = [{"role": "user", "content": "3+4="}]
    assert direct.chat_template == auto.chat_template
    if auto.chat_template is not None:
        assert (direct.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.torch
def test_the_chosen_class_imports_no_model_configuration(tiny_assets):
    probe = ("import sys; from realign.data.tokenizer import load_tokenizer; "
             f"t = load_tokenizer({str(tiny_assets['actor'])!r}, cls='TokenizersBackend'); "
             "print(t.eos_token_id, sorted(m for m in ('transformers.activations', "
             "'transformers.models.llama.configuration_llama', 'torch._dynamo') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split(maxsplit=1) == ["2", "[]\n"]


@pytest.mark.torch
def test_a_class_transformers_does_not_have_is_refused(tiny_assets):
    with pytest.raises(UserError) as e:
        load_tokenizer(tiny_assets["actor"], cls="NoSuchTokenizer")
    assert e.value.field == "models.actor" and "NoSuchTokenizer" in str(e.value)
