"""Deterministic, resumable sampling of training items: epoch-wise shuffles keyed by the seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pjray.types import JudgeItem


@dataclass
class SamplerState:
    consumed: int = 0  # items handed out since the start of training, over all epochs


class ItemSampler:
    """Hands out items in a seeded shuffle per epoch. The whole future sequence is a function of
    (seed, consumed), so a checkpoint only needs `consumed` to resume at the same position."""

    def __init__(self, items: list[JudgeItem], seed: int, state: SamplerState | None = None):
        if not items:
            raise ValueError("the training set is empty")
        self.items = items
        self.seed = seed
        self.state = state or SamplerState()
        self._epoch = -1
        self._perm: list[int] = []

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._perm = list(range(len(self.items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._epoch = epoch
        return self._perm

    @property
    def epoch(self) -> int:
        return self.state.consumed // len(self.items)

    def take(self, n: int) -> list[tuple[int, JudgeItem]]:
        """The next n items with their global sample index (stable across resumes)."""
        out = []
        for _ in range(n):
            index = self.state.consumed
            epoch, offset = divmod(index, len(self.items))
            out.append((index, self.items[self._order(epoch)[offset]]))
            self.state.consumed += 1
        return out
