"""A judge as the reward of a policy: how a group's G answers become G rewards (pure functions).

A call shows the judge some answers of one group under letters A, B, ... (`Call`: the answers'
indices in letter order) and its verdict gives each shown answer points in [0, 1]
(`verdict_points`): by its rank in a ranking (best 1, worst 0), by the pair verdict (1 / 0, a tie
1/2 each), or by its score ((s - 1) / 9). The design (`subsets`, `calls`):

- ranking and pair (K = 2): each round splits the group at random into subsets of K answers, and
  each subset is judged under all K rotations of its letters. Every answer is shown under every
  letter equally often, so a judge that always prefers "A" gives every answer the same reward;
  and the rotations of a subset tell whether a verdict follows the answers or their letters
  (`position_consistency`);
- score: each answer alone, once a round.

A group's answers are judged by their distinct texts (`distinct_answers`): copies share one
reward, and a subset holds at most as many answers as the group has distinct ones.

An answer's reward: the mean of its points (Borda: its mean normalised rank), or the strength of a
Plackett-Luce (ranking) or Bradley-Terry (pair) fit, as the chance of beating another answer of its
group. An unreadable verdict gives its answers nothing; an answer with no readable verdict gets
its group's mean (`fill_unread`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pjray.data.prompts import LETTERS, SCORE_MAX, SCORE_MIN

Call = tuple[int, ...]  # the indices of a group's answers shown under letters A, B, ...
Points = tuple[float, ...]  # per letter of a call: what its answer earned in [0, 1]

PROTOCOLS = ("ranking", "pair", "score")
AGGREGATES = ("borda", "plackett_luce")
UNREAD_REWARD = 0.5  # a group in which no verdict could be read: every answer alike


def subsets(group_size: int, k: int, rounds: int, key: str) -> list[tuple[int, ...]]:
    """`rounds` random partitions of the answers 0..group_size-1 into subsets of `k`, drawn from
    `key` (the same key, the same design). When `k` does not divide the group, a round's last
    subset is filled up with answers drawn from the rest of the round; their extra appearance is
    rotated through every letter like any other, so it adds no position bias."""
    if not 1 <= k <= group_size:
        raise ValueError(f"a group of {group_size} answers has no subsets of {k}")
    out: list[tuple[int, ...]] = []
    for r in range(rounds):
        rng = random.Random(f"{key}/round/{r}")
        order = list(range(group_size))
        rng.shuffle(order)
        for i in range(0, group_size, k):
            subset = order[i : i + k]
            if len(subset) < k:
                subset += rng.sample(order[:i], k - len(subset))
            out.append(tuple(subset))
    return out


def distinct_answers(answers: Sequence[str]) -> tuple[list[str], list[int]]:
    """The distinct answers of a group in first-seen order, and for each answer the index of its
    text among them: the same text is judged once and earns one reward, and two copies are never
    ranked against each other (a verdict between them could only follow the letters)."""
    distinct = list(dict.fromkeys(answers))
    return distinct, [distinct.index(a) for a in answers]


def calls(design: Sequence[tuple[int, ...]]) -> list[Call]:
    """Each subset under each rotation of its letters, subset by subset: (a, b, c) -> (a, b, c),
    (b, c, a), (c, a, b)."""
    return [tuple(s[r:] + s[:r]) for s in design for r in range(len(s))]


def verdict_points(protocol: str, verdict: str | int | None, k: int) -> Points | None:
    """What each letter of a call earned from its verdict: `ranking`, letters best -> worst
    ("BCA" -> A 0, B 1, C 1/2); `pair`, "A", "B" or "C" (tie); `score`, an integer 1-10. None
    for an unreadable verdict (None, or one that does not fit the call)."""
    if verdict is None:
        return None
    if protocol == "score":
        if not isinstance(verdict, int) or not SCORE_MIN <= verdict <= SCORE_MAX:
            return None
        return ((verdict - SCORE_MIN) / (SCORE_MAX - SCORE_MIN),)
    if protocol == "pair":
        return {"A": (1.0, 0.0), "B": (0.0, 1.0), "C": (0.5, 0.5)}.get(str(verdict))
    letters = str(verdict)
    if sorted(letters) != list(LETTERS[:k]):
        return None
    points = [0.0] * k
    for rank, letter in enumerate(letters):
        points[LETTERS.index(letter)] = 1.0 - rank / (k - 1) if k > 1 else 1.0
    return tuple(points)


def borda(group_size: int, shown: Sequence[Call], points: Sequence[Points | None]) -> list[float | None]:
    """Each answer's mean points over the readable calls that showed it (None: no such call)."""
    sums, counts = [0.0] * group_size, [0] * group_size
    for call, earned in zip(shown, points):
        if earned is None:
            continue
        for answer, p in zip(call, earned):
            sums[answer] += p
            counts[answer] += 1
    return [s / c if c else None for s, c in zip(sums, counts)]


def rankings(shown: Sequence[Call], points: Sequence[Points | None]) -> list[tuple[tuple[int, ...], float]]:
    """The readable calls as (answers best -> worst, weight): a tie (equal points, the pair
    protocol's "C") becomes both orders at weight 1/2."""
    out = []
    for call, earned in zip(shown, points):
        if earned is None:
            continue
        order = tuple(a for _, a in sorted(zip(earned, call), key=lambda x: -x[0]))
        if len(set(earned)) < len(earned):
            out += [(order, 0.5), (tuple(reversed(order)), 0.5)]
        else:
            out.append((order, 1.0))
    return out


def plackett_luce(
    group_size: int, shown: Sequence[Call], points: Sequence[Points | None], iterations: int = 200
) -> list[float | None]:
    """Each answer's chance of beating another answer of its group, mean over the others, under
    the Plackett-Luce strengths fitted to the readable verdicts (Hunter's MM algorithm; on pairs,
    Bradley-Terry, ties as half a win each). A prior of one tie against a strength-1 answer keeps
    an answer that wins or loses everything finite. None: an answer no readable call showed."""
    observed = rankings(shown, points)
    seen = {a for order, _ in observed for a in order}
    w = [1.0] * group_size
    for _ in range(iterations):
        wins = [0.5] * group_size  # the prior's half win
        denominators = [1.0 / (w[i] + 1.0) for i in range(group_size)]  # the prior's comparison
        for order, weight in observed:
            for stage in range(len(order) - 1):
                wins[order[stage]] += weight
                remaining = order[stage:]
                total = sum(w[a] for a in remaining)
                for a in remaining:
                    denominators[a] += weight / total
        w = [wins[i] / denominators[i] for i in range(group_size)]
    rewards: list[float | None] = []
    for i in range(group_size):
        others = [j for j in range(group_size) if j != i and j in seen]
        if i not in seen:
            rewards.append(None)
        elif not others:
            rewards.append(0.5)
        else:
            rewards.append(sum(w[i] / (w[i] + w[j]) for j in others) / len(others))
    return rewards


def fill_unread(rewards: Sequence[float | None]) -> list[float]:
    """`rewards` with each None replaced by the group's mean of the others (UNREAD_REWARD when
    there are none)."""
    read = [r for r in rewards if r is not None]
    fill = sum(read) / len(read) if read else UNREAD_REWARD
    return [fill if r is None else r for r in rewards]


def position_consistency(shown: Sequence[Call], points: Sequence[Points | None]) -> tuple[int, int]:
    """(consistent, judged) subsets: a subset is judged when every rotation of it got a readable
    verdict, consistent when all of them give each answer the same points, i.e. the verdict
    follows the answers, not their letters. `shown` is `calls(design)`: rotations side by side."""
    judged = consistent = 0
    i = 0
    while i < len(shown):
        k = len(shown[i])
        earned = points[i : i + k]
        if k > 1 and all(p is not None for p in earned):
            judged += 1
            per_answer = [dict(zip(call, p)) for call, p in zip(shown[i : i + k], earned)]  # type: ignore[arg-type]
            consistent += all(d == per_answer[0] for d in per_answer)
        i += k
    return consistent, judged


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Kendall's tau-b between two score lists (ties allowed); None when either is constant."""
    concordant = discordant = ties_a = ties_b = 0
    n = len(a)
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    pairs_a = concordant + discordant + ties_b  # pairs that a orders
    pairs_b = concordant + discordant + ties_a
    if not pairs_a or not pairs_b:
        return None
    return (concordant - discordant) / (pairs_a * pairs_b) ** 0.5


def group_rewards(
    protocol: str, aggregate: str, group_size: int, shown: Sequence[Call], points: Sequence[Points | None]
) -> list[float]:
    """The group's rewards from its calls' points: Borda means (score, and ranking with
    aggregate=borda), Plackett-Luce (ranking with aggregate=plackett_luce) or Bradley-Terry
    (pair) strengths; answers without a readable verdict get the group's mean."""
    if protocol == "pair" or (protocol == "ranking" and aggregate == "plackett_luce"):
        return fill_unread(plackett_luce(group_size, shown, points))
    return fill_unread(borda(group_size, shown, points))
