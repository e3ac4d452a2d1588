"""Pure reward and distance functions over verdict strings.

Rankings are strings of candidate letters, best -> worst ("BAC"). Two batch rewards:

- `levenshtein_reward`: the paper's R_Batch = 1 - d_Lev(pred, target) / |target|. Between two
  permutations of 3 letters the distance is 0 or 2, so on K=3 it only takes the values 1 and 1/3
  (the paper's text lists {1, 2/3, 1/3, 0}, which this formula cannot produce on permutations).
- `kendall_reward`: 1 - discordant pairs / (K(K-1)/2), the released Perception-Judge reward
  (a lookup table for K=3 there), generalised to any K: on K=3 it takes {1, 2/3, 1/3, 0}.
"""

from __future__ import annotations

import Levenshtein


def levenshtein_distance(pred: str, target: str) -> int:
    """Raw edit distance (insert, delete, substitute; cost 1): MLLM-as-a-Judge's batch metric."""
    return Levenshtein.distance(pred, target)


def normalized_levenshtein(pred: str, target: str) -> float:
    """distance / max(len(pred), len(target)) in [0, 1], the downstream judges' batch metric.

    Two empty strings are at distance 0.
    """
    longest = max(len(pred), len(target))
    return Levenshtein.distance(pred, target) / longest if longest else 0.0


def levenshtein_reward(pred: str, target: str) -> float:
    """R_Batch = max(0, 1 - d_Lev(pred, target) / len(target)); 1.0 iff pred == target."""
    if not target:
        raise ValueError("levenshtein_reward: empty target")
    return max(0.0, 1.0 - Levenshtein.distance(pred, target) / len(target))


def kendall_reward(pred: str, target: str) -> float:
    """1 - (discordant pairs) / (K(K-1)/2) when pred is a permutation of target, else 0.0.

    A pair of candidates is discordant when pred orders it the other way round from target.
    1.0 iff pred == target; 0.0 for the exact reverse.
    """
    k = len(target)
    if k == 0 or len(set(target)) != k:
        raise ValueError(f"kendall_reward: target {target!r} must be non-empty with distinct letters")
    if len(pred) != k or set(pred) != set(target):
        return 0.0
    if k == 1:
        return 1.0
    # Rank of each letter in pred, read along target: discordant pairs are its inversions.
    pos = {c: i for i, c in enumerate(pred)}
    ranks = [pos[c] for c in target]
    discordant = sum(1 for i in range(k) for j in range(i + 1, k) if ranks[i] > ranks[j])
    return 1.0 - discordant / (k * (k - 1) / 2)


def pair_reward(pred_letter: str | None, target_letter: str) -> float:
    """1.0 when the verdict letter ("A", "B", or "C" for a tie) equals the target, else 0.0."""
    return 1.0 if pred_letter is not None and pred_letter == target_letter else 0.0


def score_reward(pred_score: int | None, target_score: int, max_score: int = 10) -> float:
    """max(0, 1 - |pred - target| / (max_score - 1)) for scores on the scale 1..max_score.

    Linear in the error: 1.0 when equal, 0.0 at the opposite ends of the scale (or beyond, for a
    prediction off the scale). None (no readable score) gives 0.0.
    """
    if max_score < 2:
        raise ValueError(f"score_reward: max_score must be >= 2, got {max_score}")
    if pred_score is None:
        return 0.0
    return max(0.0, 1.0 - abs(pred_score - target_score) / (max_score - 1))


def shuffled_target(target: str, key: str) -> str:
    """`target`'s letters in an order drawn from `key` alone (one fixed random ranking per key):
    the shuffled-target control's target, which no image or text of the prompt determines."""
    import random

    letters = list(target)
    random.Random(f"pjray.shuffled_target:{key}").shuffle(letters)
    return "".join(letters)
