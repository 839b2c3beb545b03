"""A rule-based verifier for arithmetic answers (pure Python).

``math_verify`` is 1.0 when the last number in the response equals the reference
answer's number, else 0.0. Numbers are compared exactly as decimals (``7`` equals
``7.0``; thousands separators ``1,000`` are read); a ``-`` is a sign only when it
does not follow a letter, digit or dot (``3-4`` holds 3 and 4, ``= -4`` holds -4).

``math_verify_format`` adds a small format credit, ``FORMAT_CREDIT`` (0.1), for a
wrong answer given in the expected form: the whole response (stripped) is one number.
A right answer scores 1.0 under both.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from realign.errors import UserError

FORMAT_CREDIT = 0.1
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def numbers(text: str) -> list[Decimal]:
    """The numbers in ``text``, in order: ``numbers("3-4 is -1.50") == [3, 4, -1.50]``."""
    return [Decimal(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def last_number(text: str) -> Decimal | None:
    found = numbers(text)
    return found[-1] if found else None


def _reference(answer) -> Decimal:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return Decimal(str(answer))
    if isinstance(answer, str):
        try:
            return Decimal(answer.strip().replace(",", ""))
        except InvalidOperation:
            ref = last_number(answer)
            if ref is not None:
                return ref
    raise UserError(f"the reference answer {answer!r} holds no number (math_verify needs "
                    f"numeric answers)", field="data.answer_key")


def math_verify(prompt: str, response: str, answer) -> float:
    """1.0 if the last number in ``response`` equals the number of ``answer``, else 0.0.
    ``prompt`` is unused (kept for the reward-function signature)."""
    got = last_number(response)
    return 1.0 if got is not None and got == _reference(answer) else 0.0


def math_verify_format(prompt: str, response: str, answer) -> float:
    """``math_verify``, plus ``FORMAT_CREDIT`` for a wrong answer that is one bare number."""
    if math_verify(prompt, response, answer):
        return 1.0
    return FORMAT_CREDIT if NUMBER.fullmatch(response.strip()) else 0.0
