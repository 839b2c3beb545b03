"""Dataset loading: the tiny datasets parse with the real tokenizer; every bad input
gives a DataError (a UserError) naming the file, the line and the key."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from realign.data.config import DatasetConfig
from realign.data.datasets import PreferenceExample, PromptExample, SFTExample, load_dataset
from realign.data.errors import DataError
from realign.errors import UserError
from realign.paths import YAML_DIR


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ---- the tiny datasets, real tokenizer ------------------------------------------------

@pytest.mark.torch
def test_tiny_datasets_load(tiny_assets, tokenizer):
    eos = tokenizer.eos_token_id
    math = load_dataset(DatasetConfig(path=str(tiny_assets["math_train"]), kind="prompts"),
                        tokenizer)
    assert len(math) == 80 and isinstance(math[0], PromptExample)
    first = json.loads(tiny_assets["math_train"].read_text().splitlines()[0])
    assert (math[0].prompt, math[0].answer, math[0].line) == (first["prompt"], first["answer"], 1)
    assert math[0].prompt_ids == tokenizer(first["prompt"]).input_ids
    assert tokenizer.decode(math[0].prompt_ids, skip_special_tokens=True) == first["prompt"]

    in_yaml = {YAML_DIR: tiny_assets["prefs"].parent}   # a relative path, as a YAML gives it
    prefs = load_dataset(DatasetConfig.model_validate(
        {"path": "prefs.jsonl", "kind": "preferences"}, context=in_yaml), tokenizer)
    p = prefs[0]
    assert isinstance(p, PreferenceExample)
    assert p.chosen_ids[-1] == eos and p.rejected_ids[-1] == eos
    assert p.chosen_ids != p.rejected_ids

    sft = load_dataset(DatasetConfig(path=str(tiny_assets["sft"]), kind="sft"), tokenizer)
    s = sft[0]
    assert isinstance(s, SFTExample) and s.response_ids[-1] == eos
    assert tokenizer.decode(s.prompt_ids + s.response_ids, skip_special_tokens=True) == \
        first["prompt"] + first["answer"]


@pytest.mark.torch
def test_chat_prompts_use_the_template(tmp_path, tokenizer):
    f = _write(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": 4}])
    ds = load_dataset(DatasetConfig(path=str(f), kind="prompts"), tokenizer)
    assert ds[0].answer == "4"
    assert tokenizer.decode(ds[0].prompt_ids) == "<s>user: 2+2=\nassistant: "
    f = _write(tmp_path / "chat_sft.jsonl", [
        {"prompt": "3+3=", "response": "6"},
        {"messages": [{"role": "user", "content": "1+1="},
                      {"role": "assistant", "content": "2"}]}])
    sft = load_dataset(DatasetConfig(path=str(f), kind="sft"), tokenizer)
    assert tokenizer.decode(sft[1].prompt_ids) == "<s>user: 1+1=\nassistant: "
    assert tokenizer.decode(sft[1].response_ids) == "2</s>"


@pytest.mark.torch
def test_a_conversation_trains_every_assistant_turn_and_nothing_else(tmp_path, tokenizer):
    from realign.algorithms.sft import prepare
    from realign.data.collate import collate_sft

    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    f = _write(tmp_path / "multi.jsonl", [{"messages": chat},
                                          {"prompt": "3+3=", "response": "6"}])
    ds = load_dataset(DatasetConfig(path=str(f), kind="sft"), tokenizer)
    e = ds[0]
    assert tokenizer.decode(e.prompt_ids) == "<s>user: 1+1=\nassistant: 2\nuser: 2+2=\nassistant: "
    assert tokenizer.decode(e.response_ids) == "4</s>"
    (a, b), = e.assistant_spans
    assert tokenizer.decode(e.prompt_ids[a:b]) == "2\n"      # the turn and its end
    assert ds[1].assistant_spans == ()
    batch = prepare(collate_sft([e, ds[1]], tokenizer.pad_token_id), None)
    # log-prob position t scores token t + 1: the trained tokens are the earlier turn's
    # and the response's, nothing of the users' turns
    trained = [t + 1 for t in range(batch["loss_mask"].shape[1]) if batch["loss_mask"][0, t]]
    want = list(range(a, b)) + list(range(len(e.prompt_ids), len(e.prompt_ids) + 2))
    assert trained == want
    assert batch["loss_mask"][1].sum() == 2                   # "6</s>"


@pytest.mark.torch
def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    """Qwen3's thinking switch is a template variable: the data option passes it."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{% if enable_thinking is defined and "
                         "not enable_thinking %}no {% endif %}ok{% endif %}")
    f = _write(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}],
                                       "answer": 2}])
    on = load_dataset(DatasetConfig(path=str(f), kind="prompts"), tok)
    off = load_dataset(DatasetConfig(path=str(f), kind="prompts",
                                     chat_template_kwargs={"enable_thinking": False}), tok)
    assert tok.decode(on[0].prompt_ids) == "1+1=ok"
    assert tok.decode(off[0].prompt_ids) == "1+1=no ok"


# ---- errors (torch-free, a character tokenizer) ------------------------------------

def _err(tmp_path, char_tok, lines, kind="prompts", **cfg) -> DataError:
    f = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as e:
        load_dataset(DatasetConfig(path=str(f), kind=kind, **cfg), char_tok, field="data.train")
    assert isinstance(e.value, UserError) and e.value.field == "data.train.path"
    assert str(f) in str(e.value)
    return e.value


@pytest.mark.pure
def test_missing_file(tmp_path, char_tok):
    with pytest.raises(DataError, match="no such file") as e:
        load_dataset(DatasetConfig.model_validate({"path": "nope.jsonl", "kind": "prompts"},
                                                  context={YAML_DIR: tmp_path}), char_tok)
    assert e.value.path == str(tmp_path / "nope.jsonl") and e.value.line is None
    with pytest.raises(DataError, match="is a folder"):
        load_dataset(DatasetConfig(path=str(tmp_path), kind="prompts"), char_tok)


@pytest.mark.pure
def test_empty_dataset(tmp_path, char_tok):
    e = _err(tmp_path, char_tok, ["", "   "])
    assert "empty" in str(e) and e.line is None


@pytest.mark.pure
def test_bad_json_line(tmp_path, char_tok):
    e = _err(tmp_path, char_tok, [{"prompt": "1+1=", "answer": "2"}, "", '{"prompt": "2+2=",'])
    assert e.line == 3 and "not valid JSON" in str(e) and "line 3" in str(e)
    e = _err(tmp_path, char_tok, [{"prompt": "1+1=", "answer": "2"}, "[1, 2]"])
    assert e.line == 2 and "JSON object" in str(e)


@pytest.mark.pure
def test_missing_key(tmp_path, char_tok):
    e = _err(tmp_path, char_tok, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    assert (e.line, e.key) == (2, "answer") and "missing" in str(e)
    assert "line 2, key 'answer'" in str(e)
    e = _err(tmp_path, char_tok, [{"question": "1+1="}], answer_key=None)
    assert (e.line, e.key) == (1, "prompt") and "['question']" in str(e)
    e = _err(tmp_path, char_tok, [{"prompt": "p", "chosen": "a"}], kind="preferences")
    assert e.key == "rejected"


@pytest.mark.pure
def test_custom_keys_and_optional_answer(tmp_path, char_tok):
    f = _write(tmp_path / "q.jsonl", [{"q": "1+1=", "a": 2}, {"q": "x"}])
    with pytest.raises(DataError):
        load_dataset(DatasetConfig(path=str(f), kind="prompts", prompt_key="q", answer_key="a"),
                     char_tok)
    ds = load_dataset(DatasetConfig(path=str(f), kind="prompts", prompt_key="q",
                                    answer_key=None), char_tok)
    assert [x.answer for x in ds.examples] == [None, None]
    assert ds[1].prompt_ids == [1, ord("x") + 10]


@pytest.mark.pure
def test_wrong_types(tmp_path, char_tok):
    e = _err(tmp_path, char_tok, [{"prompt": 5, "answer": "2"}])
    assert e.key == "prompt" and "string" in str(e)
    e = _err(tmp_path, char_tok, [{"prompt": "", "answer": "2"}])
    assert e.key == "prompt"
    e = _err(tmp_path, char_tok, [{"prompt": "1+1=", "answer": [2]}])
    assert e.key == "answer"
    e = _err(tmp_path, char_tok, [{"prompt": [{"role": "user"}], "answer": "2"}])
    assert e.key == "prompt" and "messages" in str(e)
    e = _err(tmp_path, char_tok, [{"messages": [{"role": "user", "content": "hi"}]}], kind="sft")
    assert e.key == "messages" and "assistant" in str(e)


@pytest.mark.pure
def test_chat_needs_a_template(tmp_path, char_tok):
    e = _err(tmp_path, char_tok, [{"prompt": "a", "answer": "1"},
                                  {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    assert (e.line, e.key) == (2, "prompt") and "chat template" in str(e)


@pytest.mark.pure
def test_a_template_that_rewrites_earlier_turns_cannot_train_them(tmp_path):
    """A template that renders a turn otherwise once later ones follow (here: it numbers
    turns from the end) leaves the earlier assistant turns' tokens unknown: refused,
    naming the line."""
    from tests.data.conftest import CharTokenizer

    class FromTheEnd(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            n = len(messages)
            return "".join(f"{n - i}{m['role']}: {m['content']}\n" for i, m in enumerate(messages))

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    e = _err(tmp_path, FromTheEnd(chat_template="x"), [{"messages": chat}], kind="sft")
    assert (e.line, e.key) == (1, "messages") and "one assistant turn per line" in str(e)


@pytest.mark.pure
def test_too_long(tmp_path, char_tok):
    ok = {"prompt": "1+1=", "answer": "2"}
    e = _err(tmp_path, char_tok, [ok, ok, {"prompt": "12345+1=", "answer": "x"}],
             max_prompt_len=8)                           # <s> + 8 characters = 9 tokens
    assert (e.line, e.key) == (3, "prompt") and "9 tokens" in str(e)
    assert "max_prompt_len=8" in str(e)
    e = _err(tmp_path, char_tok, [{"prompt": "p", "chosen": "ab", "rejected": "abc"}],
             kind="preferences", max_response_len=3)     # 'abc' + </s> = 4 tokens
    assert (e.line, e.key) == (1, "rejected")
    e = _err(tmp_path, char_tok, [{"prompt": "p", "response": "abcd"}], kind="sft",
             max_response_len=4)
    assert e.key == "response"


@pytest.mark.pure
def test_config_is_strict(tmp_path):
    with pytest.raises(ValidationError, match="extra"):
        DatasetConfig(path="x", kind="prompts", promt_key="q")
    with pytest.raises(ValidationError):
        DatasetConfig(path="x", kind="rlhf")
    with pytest.raises(ValidationError, match="must differ"):
        DatasetConfig(path="x", kind="preferences", chosen_key="a", rejected_key="a")
    with pytest.raises(ValidationError):
        DatasetConfig(path="x", kind="prompts", max_prompt_len=0)
    for name, f in DatasetConfig.model_fields.items():
        assert f.description, name


@pytest.mark.pure
def test_data_modules_are_torch_free():
    import subprocess
    import sys

    code = ("import sys, realign.data.datasets, realign.data.sampler, realign.rewards.registry; "
            "sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
