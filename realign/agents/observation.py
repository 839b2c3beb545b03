"""An observation cut to ``rollout.max_observation_tokens`` without tokenizing all of
it: only its first :func:`observation_chars` characters are ever tokenized (and read
from a tool's answer), then the tokens are cut exactly.

Why the two cuts give the tokens a whole tokenization would: a token covers at most
:data:`MAX_CHARS_PER_TOKEN` characters of the text, so the first ``n`` tokens of the
whole text lie within its first ``n * MAX_CHARS_PER_TOKEN`` characters; a tokenizer's
split of the text (its pre-tokenizer, BPE merges) depends on what follows a token only
over a short stretch, which :data:`MARGIN_CHARS` more characters cover. A word the
character cut splits lies past the tokens that are kept.

The rule, exactly: the observation is ``encode(text[:observation_chars(n)])[:n]``.
Under a tokenizer with tokens longer than ``MAX_CHARS_PER_TOKEN`` characters, a text
made of such tokens gives fewer than ``n``: the observation ends at the character
bound.
"""
from __future__ import annotations

from typing import Callable

#: an upper bound of the characters one token covers (a byte-level BPE token covers
#: at most as many characters as it has bytes; SentencePiece's trainer caps pieces at
#: 16 characters unless told otherwise)
MAX_CHARS_PER_TOKEN = 256
#: characters tokenized past the last token that can be kept
MARGIN_CHARS = 256


def observation_chars(max_tokens: int) -> int:
    """The most characters of an observation, or of one tool's answer, that are read
    and tokenized. Example: 64 tokens (the default) -> 64 * 256 + 256 = 16,640."""
    return max_tokens * MAX_CHARS_PER_TOKEN + MARGIN_CHARS


def cut_observation(text: str, encode: Callable[[str], list[int]], max_tokens: int
                    ) -> tuple[list[int], bool]:
    """(the observation's token ids, at most ``max_tokens``; whether anything of
    ``text`` was left out). ``encode`` sees at most :func:`observation_chars`
    characters; a text within that bound is tokenized whole, as it is.

    >>> cut_observation("abcdef", lambda s: [ord(c) for c in s], 4)
    ([97, 98, 99, 100], True)
    >>> ids, cut = cut_observation("x" * 10**7, lambda s: [ord(c) for c in s], 2)
    >>> len(ids), cut
    (2, True)
    """
    chars = observation_chars(max_tokens)
    ids = list(encode(text[:chars]))
    return ids[:max_tokens], len(text) > chars or len(ids) > max_tokens
