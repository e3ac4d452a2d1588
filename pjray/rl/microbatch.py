"""How a rank's sequences are cut into micro-batches under a token budget (pure functions).

A judge's sequences vary tenfold in length (images of 64 to 1,280 tokens, responses of 50 to
thousands), so a fixed number of sequences per micro-batch is mostly padding, or runs out of
memory on the batch that happens to hold the longest ones. `token_budget_batches` cuts by
tokens instead (`learner.micro_batch_tokens`):

* packed (`learner.packing`): a micro-batch costs the sum of its sequences' lengths; the
  sequences are spread over the fewest micro-batches the budget allows, balanced by the largest
  differencing method (Karmarkar-Karp), so no micro-batch is much longer than the others.
* padded: a micro-batch costs rows x its longest row; cut the sequences sorted by length into
  consecutive runs, so each row is padded to a neighbour's length.

The loss normalises by the step's global counts (`pjray.rl.grpo`), so the gradient of a step
does not depend on how it is cut. Every rank must run as many micro-batches as the others (ZeRO
reduces and gathers per micro-batch); the learner pads the shorter lists with micro-batches that
train nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

__all__ = ["batch_cost", "karmarkar_karp", "token_budget_batches"]


def karmarkar_karp(costs: Sequence[int], parts: int) -> list[list[int]]:
    """The indices of `costs` split into `parts` lists whose sums are balanced, by the largest
    differencing method: repeatedly merge the two partial partitions whose largest and smallest
    sums differ most, largest sum with smallest. Lists are in ascending index order; some are
    empty when there are fewer costs than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    tie = itertools.count()
    # Each entry: (-spread, tie, sums, members), sums ascending with their members alongside.
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    for i, c in enumerate(costs):
        sums = [0] * (parts - 1) + [int(c)]
        members: list[list[int]] = [[] for _ in range(parts - 1)] + [[i]]
        heapq.heappush(heap, (-int(c), next(tie), sums, members))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        # Largest of one with smallest of the other.
        merged = sorted(
            ((sums_a[k] + sums_b[parts - 1 - k], members_a[k] + members_b[parts - 1 - k]) for k in range(parts)),
            key=lambda pair: pair[0],
        )
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(sums[-1] - sums[0]), next(tie), sums, [m for _, m in merged]))
    return [sorted(m) for m in heap[0][3]]


def batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a micro-batch of sequences of `lengths` forwards: their sum packed, else rows x
    the longest."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def token_budget_batches(lengths: Sequence[int], budget: int, packed: bool) -> list[list[int]]:
    """The indices of sequences of `lengths` cut into micro-batches of at most `budget` tokens
    each (`batch_cost`); a sequence longer than the budget forms a micro-batch of its own.
    Packed: the fewest balanced micro-batches (`karmarkar_karp`) that fit. Padded: consecutive
    runs of the sequences sorted longest first. Lists are nonempty, in ascending index order,
    and together hold every index once."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    n = len(lengths)
    if n == 0:
        return []
    if packed:
        alone = [[i] for i in range(n) if lengths[i] > budget]
        rest = [i for i in range(n) if lengths[i] <= budget]
        if not rest:
            return alone
        costs = [lengths[i] for i in rest]
        # At least total / budget parts; one more until the balanced split fits (one part a
        # sequence always does).
        for parts in range(max(1, math.ceil(sum(costs) / budget)), len(rest) + 1):
            split = [[rest[k] for k in p] for p in karmarkar_karp(costs, parts) if p]
            if all(batch_cost([lengths[i] for i in p], True) <= budget for p in split):
                return sorted(alone + split)
        raise AssertionError("unreachable: one sequence a part always fits")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    run: list[int] = []
    for i in order:
        # Sorted longest first: the run's first row is its longest.
        if run and (len(run) + 1) * lengths[run[0]] > budget:
            out.append(sorted(run))
            run = []
        run.append(i)
    out.append(sorted(run))
    return out
