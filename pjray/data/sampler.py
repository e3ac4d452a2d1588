"""Deterministic, resumable sampling of training items: epoch-wise shuffles keyed by the seed,
and the order in which each prompt of the stream shows its candidates."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from pjray.types import JudgeItem


@dataclass
class SamplerState:
    consumed: int = 0  # items handed out since the start of training, over all epochs


# Up to this many candidates the stream shows every order once per block of k! prompts (24 at 4);
# more would make a block longer than a run's window of steps.
MAX_BALANCED_CANDIDATES = 4


def shown_order(index: int, k: int, seed: int) -> tuple[int, ...]:
    """The order in which the `index`-th prompt of the training stream shows its `k` candidates
    (`shown[i]`: the candidate under letter i).

    Balanced: each block of k! consecutive prompts shows every order once, the block in a
    shuffle of its own (seeded by `seed` and the block). So any window of prompts shows each
    order about equally often, and one that keeps the shown order (a judge's position bias) earns
    the same reward in every window: with K = 3 a 5-step window of 8 prompts holds the exact
    ranking 6 or 7 times in 40 instead of a binomial 6.7 +- 2.4, and the reward curve shows what
    the policy learned rather than which orders were drawn. Past MAX_BALANCED_CANDIDATES, a
    seeded shuffle per prompt. A function of (index, k, seed) only, so resumes keep it.
    """
    if k > MAX_BALANCED_CANDIDATES:
        order = list(range(k))
        random.Random(f"{seed}/{index}").shuffle(order)
        return tuple(order)
    block, offset = divmod(index, math.factorial(k))
    orders = list(itertools.permutations(range(k)))
    random.Random(f"{seed}/block/{block}").shuffle(orders)
    return orders[offset]


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
