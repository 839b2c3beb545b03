"""The reward of the tiny arithmetic task (used as ``reward.fn: tiny_reward.py:shaped``).

A random tiny model almost never writes a bare number, so the exact-answer verifier
alone gives no learning signal in a few CPU minutes. This shaping keeps the exact
answer worth the most and adds dense credit on the way there:
``0.2 * (share of response characters that are digits) + 0.8 * math_verify``.
"""
from realign.rewards.math import math_verify


def shaped(prompt: str, response: str, answer) -> float:
    text = response.strip()
    digits = sum(c.isdigit() for c in text) / len(text) if text else 0.0
    return 0.2 * digits + 0.8 * math_verify(prompt, response, answer)
