"""Tiny, deterministic, offline assets for ``realign run`` on a laptop and for tests:
a small tokenizer, tiny random models and a verifiable arithmetic task.

Layout written into ``out_dir``::

    actor/        LlamaForCausalLM (policy; also the reference policy) + tokenizer
    reward/       LlamaForSequenceClassification, num_labels=1 (reward model and
                  critic initialisation) + tokenizer
    qwen2_actor/  Qwen2ForCausalLM (the same task with a Qwen2 policy) + tokenizer
    small_actor/, small_reward/  the same two at ~3.2M parameters each (width 256, 4
                  layers): big enough that arithmetic, not Python, dominates a step on
                  one CPU core (``experiments/bench-ppo-cpu.yaml``)
    math_train.jsonl, math_eval.jsonl   {"prompt": "3+4=", "answer": "7"}
    prefs.jsonl                         {"prompt", "chosen", "rejected"}
    sft.jsonl                           {"prompt", "response"}

The task: ``a+b=`` with single digits ``a, b`` (100 problems; 80 for training, 20
held out for evaluation, split by ``seed``). Answers are one or two digit tokens; a
policy that emits the right digits and then ``</s>`` scores 1 under ``math_verify``.
``max_operand`` makes it easier (4: 25 problems, answers 0..8, one token each).

From the random models a plain GRPO loop learns the task, but slowly; an SFT warm
start on ``sft.jsonl`` makes it fast (benchmarks/demo/README.md).

The tokenizer (:func:`build_tokenizer`) is word-level over a fixed vocabulary: the
special tokens ``<pad>`` (0), ``<s>`` (1), ``</s>`` (2), ``<unk>`` (3), each digit,
operators and punctuation, space and newline, the lowercase letters, and a few whole
words (``answer``, ``user``...). Text is lower-cased; every digit is its own token;
a word of the list is one token, any other word is spelled letter by letter, so
decoding gives the (lower-cased) text back exactly. ``<s>`` is prepended when
special tokens are added. A plain chat template (``<s>`` then ``role: content`` lines,
and ``assistant: `` as the generation prompt) is included.

Everything is a pure function of ``seed``: two calls write byte-identical files.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
DIGITS = "0123456789"
SYMBOLS = " \n+-*/=?.,:;!()'\""
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ("assistant", "question", "answer", "system", "equals", "minus", "times",
         "plus", "user", "what", "the", "is")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")

#: Architecture numbers of the tiny models (vocab_size is the tokenizer's).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, initializer_range=0.02)

#: The "small" models: ~3.2M parameters (``realign bench plans`` on CPU).
SMALL_LLAMA = dict(TINY_LLAMA, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)

#: The tiny Qwen3-MoE: 3 layers (the middle one dense), 8 experts of 32, top 2,
#: head_dim 32 (vLLM's CPU kernels need at least 32)
TINY_QWEN3_MOE = dict(TINY_LLAMA, num_hidden_layers=3, intermediate_size=96, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                      router_aux_loss_coef=0.001)

#: LLaMA 3.1's rope scaling with the pretraining window shrunk to 8 positions
TINY_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

EVAL_FRACTION = 0.2


def vocabulary(extra_symbols: str = "", extra_words: tuple[str, ...] = ()) -> list[str]:
    """The tiny tokenizer's tokens, in id order (extras after the standard ones)."""
    return [*SPECIAL_TOKENS, *DIGITS, *SYMBOLS, *LETTERS, *WORDS, *extra_symbols,
            *extra_words]


def build_tokenizer(extra_symbols: str = "", extra_words: tuple[str, ...] = ()):
    """The tiny tokenizer as a ``transformers`` fast tokenizer (see the module doc);
    ``extra_symbols`` and ``extra_words`` extend its vocabulary (the tool task's JSON
    braces and tags: :mod:`realign.assets.tiny_tools`)."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(vocabulary(extra_symbols, extra_words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # a listed word (longest first) or else any single character, newline included
    words = sorted((*WORDS, *extra_words), key=lambda w: (-len(w), w))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("(?:" + "|".join(map(re.escape, words)) + r")|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=TINY_LLAMA["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- models ------------------------------------------------------------------------

def _model_config(kind: str, vocab_size: int, head: str, arch: dict | None = None):
    import transformers as tf

    fields = dict(arch or TINY_LLAMA, vocab_size=vocab_size, pad_token_id=PAD_ID,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    cfg: tf.PretrainedConfig
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**fields, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 10000.0})
    elif kind == "qwen3":           # Qwen3's shape: q/k norms, head_dim != hidden / heads
        fields.update(head_dim=2 * fields["hidden_size"] // fields["num_attention_heads"],
                      tie_word_embeddings=True)
        cfg = tf.Qwen3Config(**fields, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6})
    elif kind == "qwen3_moe":       # a mixture of experts (default TINY_QWEN3_MOE)
        fields = dict(arch or TINY_QWEN3_MOE, vocab_size=vocab_size, pad_token_id=PAD_ID,
                      bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        cfg = tf.Qwen3MoeConfig(**fields, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6})
    elif kind == "llama31":         # LLaMA 3.1's rope scaling; the task's 12 tokens run
        cfg = tf.LlamaConfig(**fields, rope_parameters=dict(   # past its window of 8
            TINY_LLAMA31_ROPE, rope_theta=500000.0))
    else:
        cfg = tf.LlamaConfig(**fields)
    if head == "value":
        cfg.num_labels = 1
    return cfg


def make_model(folder: str | Path, kind: str = "llama", head: str = "lm", seed: int = 0,
               tokenizer=None, arch: dict | None = None) -> Path:
    """Save a tiny random ``kind`` (llama | llama31 | qwen2 | qwen3 | qwen3_moe) model with
    an LM head (``lm``) or a one-label sequence-classification head (``value``), and the
    tiny tokenizer, into ``folder``; returns the folder. ``arch``: architecture numbers
    (default :data:`TINY_LLAMA`; :data:`TINY_QWEN3_MOE` for qwen3_moe)."""
    import torch
    import transformers as tf

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    cfg = _model_config(kind, len(tokenizer), head, arch)
    cls = {("llama", "lm"): tf.LlamaForCausalLM, ("llama31", "lm"): tf.LlamaForCausalLM,
           ("qwen2", "lm"): tf.Qwen2ForCausalLM, ("qwen3", "lm"): tf.Qwen3ForCausalLM,
           ("qwen3_moe", "lm"): tf.Qwen3MoeForCausalLM,
           ("llama", "value"): tf.LlamaForSequenceClassification,
           ("qwen2", "value"): tf.Qwen2ForSequenceClassification}[(kind, head)]
    # fork_rng: the caller's global RNG state is left as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


# ---- datasets ----------------------------------------------------------------------

def math_problems(seed: int = 0, max_operand: int = 9) -> tuple[list[dict], list[dict]]:
    """All ``a+b=`` problems with ``0 <= a, b <= max_operand``, shuffled by ``seed`` and
    split into (train, eval) with ``EVAL_FRACTION`` held out."""
    if not 1 <= max_operand <= 9:
        raise ValueError(f"max_operand must be in 1..9 (single digits), got {max_operand}")
    r = range(max_operand + 1)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in r for b in r]
    random.Random(f"realign-tiny-math:{seed}").shuffle(rows)
    n_eval = round(len(rows) * EVAL_FRACTION)
    return rows[n_eval:], rows[:n_eval]


def preference_pairs(problems: list[dict], seed: int = 0) -> list[dict]:
    """One pair per problem: the right answer is chosen, a wrong number rejected (from
    0..max answer of the set)."""
    rng = random.Random(f"realign-tiny-prefs:{seed}")
    top = max(int(p["answer"]) for p in problems)
    out = []
    for p in problems:
        wrong = rng.choice([s for s in range(max(top, 1) + 1) if str(s) != p["answer"]])
        out.append({"prompt": p["prompt"], "chosen": p["answer"], "rejected": str(wrong)})
    return out


def sft_rows(problems: list[dict]) -> list[dict]:
    """Prompt/response rows: the response is the answer alone (``</s>`` follows it)."""
    return [{"prompt": p["prompt"], "response": p["answer"]} for p in problems]


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path


# ---- everything --------------------------------------------------------------------

def make_tiny_assets(out_dir: str | Path, seed: int = 0, qwen2: bool = True,
                     max_operand: int = 9, small: bool = True, families: bool = True,
                     tools: bool = True) -> dict[str, Path]:
    """Write the tiny tokenizer, models and datasets into ``out_dir`` (created if
    needed; existing files of the same names are overwritten). Returns the paths by
    name: ``actor``, ``ref`` (= actor), ``reward``, ``critic`` (= reward),
    ``qwen2_actor`` (when ``qwen2``), ``llama31_actor`` and ``qwen3_actor`` (when
    ``families``), ``small_actor`` and ``small_reward`` (when ``small``), ``math_train``,
    ``math_eval``, ``prefs``, ``sft``, and with ``tools`` the tool task's
    (:func:`realign.assets.tiny_tools.make_tool_assets`).
    ``max_operand`` (1..9) bounds the operands of the arithmetic task."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    paths: dict[str, Path] = {}
    paths["actor"] = make_model(out / "actor", "llama", "lm", seed=seed, tokenizer=tok)
    paths["ref"] = paths["actor"]
    paths["reward"] = make_model(out / "reward", "llama", "value", seed=seed + 1, tokenizer=tok)
    paths["critic"] = paths["reward"]
    if qwen2:
        paths["qwen2_actor"] = make_model(out / "qwen2_actor", "qwen2", "lm", seed=seed + 2,
                                          tokenizer=tok)
    if families:            # this year's families: LLaMA 3.1's rope scaling, Qwen3
        paths["llama31_actor"] = make_model(out / "llama31_actor", "llama31", "lm",
                                            seed=seed, tokenizer=tok)
        paths["qwen3_actor"] = make_model(out / "qwen3_actor", "qwen3", "lm", seed=seed,
                                          tokenizer=tok)
    if small:
        paths["small_actor"] = make_model(out / "small_actor", "llama", "lm", seed=seed + 3,
                                          tokenizer=tok, arch=SMALL_LLAMA)
        paths["small_reward"] = make_model(out / "small_reward", "llama", "value",
                                           seed=seed + 4, tokenizer=tok, arch=SMALL_LLAMA)
    train, evals = math_problems(seed, max_operand)
    paths["math_train"] = write_jsonl(out / "math_train.jsonl", train)
    paths["math_eval"] = write_jsonl(out / "math_eval.jsonl", evals)
    paths["prefs"] = write_jsonl(out / "prefs.jsonl", preference_pairs(train, seed))
    paths["sft"] = write_jsonl(out / "sft.jsonl", sft_rows(train))
    if tools:
        from realign.assets.tiny_tools import make_tool_assets
        paths.update(make_tool_assets(out, seed))
    return paths
