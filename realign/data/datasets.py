"""Loading a JSONL dataset into tokenized examples, every line checked.

Tokenization rules (the same for every kind):

* a string prompt is encoded with the tokenizer's special tokens (e.g. ``<s>`` first
  for LLaMA tokenizers); a chat prompt (list of ``{"role", "content"}``) is rendered
  by the tokenizer's chat template with the generation prompt, then encoded without
  adding special tokens (the template holds them);
* a response is encoded without special tokens and the end token (``eos``) appended,
  so a policy learns to stop.

``tokenizer`` is any object with the ``transformers`` tokenizer interface used here:
``tokenizer(list_of_texts, add_special_tokens=...)["input_ids"]``, ``eos_token_id``,
``chat_template`` and ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, Union

from realign.data.config import DatasetConfig
from realign.data.errors import DataError
from realign.data.jsonl import read_jsonl

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


@dataclass(frozen=True)
class PromptExample:
    """A prompt to generate from (``answer`` is what a verifier compares against)."""
    line: int
    prompt: Prompt
    answer: str | None
    prompt_ids: list[int]


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with a preferred (``chosen``) and a dispreferred (``rejected``) response."""
    line: int
    prompt: Prompt
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response to imitate; ``assistant_spans``: token ranges
    ``[start, end)`` of ``prompt_ids`` that are earlier assistant turns of a
    conversation (trained on too), empty for a single response."""
    line: int
    prompt_ids: list[int]
    response_ids: list[int]
    assistant_spans: tuple[tuple[int, int], ...] = ()


Example = Union[PromptExample, PreferenceExample, SFTExample]


@dataclass(frozen=True)
class Dataset:
    """The examples of one JSONL file, in file order."""
    config: DatasetConfig
    path: Path
    examples: tuple[Example, ...]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def take(self, indices: Sequence[int]) -> list[Example]:
        return [self.examples[i] for i in indices]


class _Lines:
    """Field checks of one file, each failure a :class:`DataError` with file/line/key."""

    def __init__(self, path: Path, field: str):
        self.path, self.field = str(path), field

    def error(self, problem: str, line: int | None = None, key: str | None = None):
        return DataError(problem, self.path, line, key, field=self.field)

    def get(self, obj: dict, key: str, line: int) -> Any:
        if key not in obj:
            raise self.error(f"missing (the line has keys {sorted(obj)}); set the dataset's "
                             f"*_key fields to the names your file uses", line, key)
        return obj[key]

    def text(self, obj: dict, key: str, line: int) -> str:
        v = self.get(obj, key, line)
        if not isinstance(v, str) or not v:
            raise self.error(f"must be a non-empty string, got {v!r:.60}", line, key)
        return v

    def answer(self, obj: dict, key: str, line: int) -> str:
        v = self.get(obj, key, line)
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise self.error(f"must be a string or a number, got {v!r:.60}", line, key)
        return str(v)

    def messages(self, v: Any, key: str, line: int) -> Messages:
        ok = isinstance(v, list) and v and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in v)
        if not ok:
            raise self.error('must be a list of {"role": str, "content": str} messages',
                             line, key)
        return [{"role": m["role"], "content": m["content"]} for m in v]

    def prompt(self, obj: dict, key: str, line: int) -> Prompt:
        v = self.get(obj, key, line)
        return self.messages(v, key, line) if isinstance(v, list) else self.text(obj, key, line)


def load_dataset(config: DatasetConfig, tokenizer, field: str = "data") -> Dataset:
    """Read, check and tokenize ``config.path``. ``field`` is where the dataset sits in
    the experiment config, for error messages."""
    path = Path(config.path)
    lines = _Lines(path, f"{field}.path")
    rows = list(read_jsonl(path, field=lines.field))
    if not rows:
        raise lines.error("the dataset is empty (no non-blank lines)")
    if tokenizer.eos_token_id is None and config.kind != "prompts":
        raise lines.error("the tokenizer has no end-of-sequence token to end responses with")
    builders: dict[str, Callable[[DatasetConfig, Any, list[Any], _Lines], Sequence[Example]]] = {
        "prompts": _prompts, "preferences": _preferences, "sft": _sft}
    build = builders[config.kind]
    return Dataset(config, path, tuple(build(config, tokenizer, rows, lines)))


# ---- per kind ----------------------------------------------------------------------

def _prompts(c: DatasetConfig, tok, rows, lines: _Lines) -> list[PromptExample]:
    prompts = [lines.prompt(o, c.prompt_key, n) for n, o in rows]
    answers = [lines.answer(o, c.answer_key, n) if c.answer_key else None for n, o in rows]
    ids = _encode_prompts(tok, prompts, rows, c, lines)
    return [PromptExample(n, p, a, i) for (n, _), p, a, i in zip(rows, prompts, answers, ids)]


def _preferences(c: DatasetConfig, tok, rows, lines: _Lines) -> list[PreferenceExample]:
    prompts = [lines.prompt(o, c.prompt_key, n) for n, o in rows]
    chosen = [lines.text(o, c.chosen_key, n) for n, o in rows]
    rejected = [lines.text(o, c.rejected_key, n) for n, o in rows]
    ids = _encode_prompts(tok, prompts, rows, c, lines)
    ch = _encode_responses(tok, chosen, rows, c, [c.chosen_key] * len(rows), lines)
    rj = _encode_responses(tok, rejected, rows, c, [c.rejected_key] * len(rows), lines)
    return [PreferenceExample(n, p, i, a, b)
            for (n, _), p, i, a, b in zip(rows, prompts, ids, ch, rj)]


def _sft(c: DatasetConfig, tok, rows, lines: _Lines) -> list[SFTExample]:
    prompts: list[Prompt] = []
    responses, keys = [], []
    for n, o in rows:
        if c.prompt_key in o or c.messages_key not in o:
            prompts.append(lines.prompt(o, c.prompt_key, n))
            responses.append(lines.text(o, c.response_key, n))
            keys.append(c.response_key)
            continue
        chat = lines.messages(o[c.messages_key], c.messages_key, n)
        if len(chat) < 2 or chat[-1]["role"] != "assistant" or not chat[-1]["content"]:
            raise lines.error("needs at least two messages, the last a non-empty "
                              "'assistant' one (the response to learn)", n, c.messages_key)
        prompts.append(chat[:-1])
        responses.append(chat[-1]["content"])
        keys.append(c.messages_key)
    ids = _encode_prompts(tok, prompts, rows, c, lines)
    out = _encode_responses(tok, responses, rows, c, keys, lines)
    spans = [(_assistant_spans(tok, p, i, c, lines, n) if not isinstance(p, str) else ())
             for (n, _), p, i in zip(rows, prompts, ids)]
    return [SFTExample(n, i, r, s) for (n, _), i, r, s in zip(rows, ids, out, spans)]


def _assistant_spans(tok, chat: Messages, ids: list[int], c: DatasetConfig, lines: _Lines,
                     line: int) -> tuple[tuple[int, int], ...]:
    """Token ranges of ``ids`` (the rendered ``chat``) that are its assistant turns: from
    the end of the conversation before the turn (rendered with the generation prompt)
    to the end of the conversation up to it (the turn's end-of-turn tokens included, so
    the model learns where a turn stops). Templates render a conversation's start the
    same whatever follows it (checked: otherwise the turns' tokens are not known)."""
    spans = []
    for j, m in enumerate(chat):
        if m["role"] != "assistant":
            continue
        if j == 0:
            raise lines.error("a conversation starts with a user (or system) message, not "
                              "an assistant one", line, c.messages_key)
        start = _render_ids(tok, chat[:j], True, c)
        end = _render_ids(tok, chat[:j + 1], False, c)
        if ids[:len(start)] != start or ids[:len(end)] != end or len(end) <= len(start):
            raise lines.error("the tokenizer's chat template renders the earlier turns "
                              "otherwise once later ones follow, so the tokens of the earlier "
                              "assistant turns cannot be told apart for the loss; give one "
                              "assistant turn per line", line, c.messages_key)
        spans.append((len(start), len(end)))
    return tuple(spans)


def _render_ids(tok, chat: Messages, generation_prompt: bool, c: DatasetConfig) -> list[int]:
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt,
                                   **c.chat_template_kwargs)
    return list(tok([text], add_special_tokens=False)["input_ids"][0])


# ---- tokenization ------------------------------------------------------------------

def _encode_prompts(tok, prompts: list[Prompt], rows, c: DatasetConfig,
                    lines: _Lines) -> list[list[int]]:
    plain = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    out: list[list[int]] = [[] for _ in prompts]
    if plain:
        enc = tok([prompts[i] for i in plain], add_special_tokens=True)["input_ids"]
        for i, e in zip(plain, enc):
            out[i] = list(e)
    if chats:
        if not getattr(tok, "chat_template", None):
            raise lines.error("chat messages need a tokenizer with a chat template; this one "
                              "has none (give prompts as strings)", rows[chats[0]][0],
                              c.prompt_key)
        texts = [tok.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True,
                                         **c.chat_template_kwargs)
                 for i in chats]
        for i, e in zip(chats, tok(texts, add_special_tokens=False)["input_ids"]):
            out[i] = list(e)
    for (n, _), ids in zip(rows, out):
        if not ids:
            raise lines.error("encodes to no tokens", n, c.prompt_key)
        if len(ids) > c.max_prompt_len:
            raise lines.error(f"the prompt is {len(ids)} tokens, more than max_prompt_len="
                              f"{c.max_prompt_len} (raise it or shorten the prompt)",
                              n, c.prompt_key)
    return out


def _encode_responses(tok, texts: list[str], rows, c: DatasetConfig, keys: list[str],
                      lines: _Lines) -> list[list[int]]:
    enc = tok(texts, add_special_tokens=False)["input_ids"]
    out = [list(e) + [tok.eos_token_id] for e in enc]
    for (n, _), ids, key in zip(rows, out, keys):
        if len(ids) > c.max_response_len:
            raise lines.error(f"the response is {len(ids)} tokens (end token included), more "
                              f"than max_response_len={c.max_response_len}", n, key)
    return out
