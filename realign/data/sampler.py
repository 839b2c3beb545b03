"""A deterministic, resumable batch sampler (pure Python, no torch).

The row indices form an endless stream: epoch 0's order, then epoch 1's, ... (each a
permutation of ``range(n)`` seeded by ``(seed, epoch)``, or ``0..n-1`` when not
shuffling). Batch ``k`` is ``stream[k*batch : (k+1)*batch]``, so every batch has
exactly ``batch`` rows, a batch may straddle two epochs, ``batch > n`` works, and no
row is dropped. The whole state is the number of indices consumed.

Example: ``n=5, batch=2, shuffle=False`` gives ``[0,1] [2,3] [4,0] [1,2] ...``.
"""
from __future__ import annotations

import random

from realign.errors import UserError


class PromptSampler:
    """Batches of row indices; ``state_dict()`` after ``k`` batches, loaded into a fresh
    sampler of the same ``(n, batch, seed, shuffle)``, continues with batch ``k+1``."""

    def __init__(self, n: int, batch: int, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise UserError(f"cannot sample from {n} rows", field="data")
        if batch < 1:
            raise UserError(f"batch must be positive, got {batch}", field="batch")
        self.n, self.batch, self.seed, self.shuffle = n, batch, seed, shuffle
        self.consumed = 0
        self._order: tuple[int, list[int]] | None = None   # (epoch, its permutation)

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        return self.consumed // self.n

    def order(self, epoch: int) -> list[int]:
        """The visiting order of ``epoch`` (a permutation of ``range(n)``)."""
        if self._order is None or self._order[0] != epoch:
            idx = list(range(self.n))
            if self.shuffle:
                random.Random(f"realign-sampler:{self.seed}:{epoch}").shuffle(idx)
            self._order = (epoch, idx)
        return self._order[1]

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch:
            epoch, offset = divmod(self.consumed, self.n)
            take = min(self.batch - len(out), self.n - offset)
            out.extend(self.order(epoch)[offset:offset + take])
            self.consumed += take
        return out

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"n": self.n, "batch": self.batch, "seed": self.seed,
                "shuffle": self.shuffle, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the dataset size, batch, seed and shuffle must be the
        ones it was saved with (else the resumed order would differ)."""
        for key in ("n", "batch", "seed", "shuffle"):
            if key not in state:
                raise UserError(f"the sampler state lacks {key!r}", field="sampler")
            if state[key] != getattr(self, key):
                what = "dataset size" if key == "n" else key
                raise UserError(f"cannot resume: saved with {what} {state[key]!r}, now "
                                f"{getattr(self, key)!r}", field=f"sampler.{key}")
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise UserError(f"bad 'consumed' in the sampler state: {consumed!r}", field="sampler")
        self.consumed = consumed
