"""The parts every tiny asset is built from (:mod:`realign.assets.tiny`'s arithmetic
task and :mod:`realign.assets.tiny_tools`' calculator task): the tiny tokenizer, the
tiny random models and the JSONL writer.

The tokenizer (:func:`build_tokenizer`) is word-level over a fixed vocabulary: the
special tokens ``<pad>`` (0), ``<s>`` (1), ``</s>`` (2), ``<unk>`` (3), each digit,
operators and punctuation, space and newline, the lowercase letters, and a few whole
words (``answer``, ``user``...). Text is lower-cased; every digit is its own token;
a word of the list is one token, any other word is spelled letter by letter, so
decoding gives the (lower-cased) text back exactly. ``<s>`` is prepended when
special tokens are added. A plain chat template (``<s>`` then ``role: content`` lines,
and ``assistant: `` as the generation prompt) is included.

Everything is a pure function of its arguments: two calls write byte-identical files.
"""
from __future__ import annotations

import json
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


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path
