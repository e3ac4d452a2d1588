"""A shortcut audit of PPJD tuples: how well the candidate texts alone, with no image, rank them.

A judge trained on tuples whose text gives the order away can learn to read the text and never
look at the image. Two rules that need no image:

- *consistency*: an answer whose reasoning contradicts itself is worse than one whose reasoning
  holds, fewer problems first (scene rows: `reasoning_problems`; free-text rows have no such
  check, so every candidate counts as consistent);
- *odd one out*: when every candidate but one states the same fact, that one is the correct
  answer. The nested construction gives it away: its two wrong candidates share their wrong
  fact, so the chosen answer is the odd one, and the worst one is the one that contradicts itself.

The audit is a lower bound on what the text gives away, not a measure of it: with K >= 4
nested levels, level 3 states a second wrong fact, no fact is then shared by all candidates but
one, and the odd-one-out rule abstains though the chosen answer is still the only one that
states the true fact.

A ranking is a list of groups best -> worst; the candidates of a group are tied. It is scored by
the expected value over a uniform random tie-break, so a rule that cannot decide scores exactly
chance (1/K correct-first, 1/K! exact ranking), and the audit needs no random draws. The expected
values are rationals and are summed as such, so chance reads exactly 1/3, not 0.33333333333333318.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from pjray.data.scenes import SceneQA, qa_from_ref
from pjray.ppjd.lexicon import find_mentions, lexemes
from pjray.ppjd.scene_checks import reasoning_problems, stated_view
from pjray.types import JudgeItem

Ranking = list[list[int]]  # candidate indices in tied groups, best group first

# The rules each audited ranker applies, in order: a later rule only breaks the earlier ones' ties.
RANKERS: dict[str, tuple[str, ...]] = {
    "consistency": ("consistency",),
    "odd_one_out": ("odd_one_out",),
    "combined": ("consistency", "odd_one_out"),
}


# --------------------------------------------------------------------------- what the text says


def scene_qa(meta: Mapping[str, Any]) -> SceneQA | None:
    """The question and scene of a row, regenerated from its scene reference (a PPJD row's
    meta["scene"], or the seed, size, object range and kind `ranked_item` records): a row holds
    only the reference, and reading its answers needs the question's subjects and answer format.
    None for a free-text row."""
    if "scene" in meta:
        return qa_from_ref(meta["scene"])
    if "scene_seed" in meta:
        return qa_from_ref(
            {
                "seed": meta["scene_seed"],
                "image_size": meta["image_size"],
                "objects": meta["objects"],
                "kind": meta["kind"],
            }
        )
    return None


def stated_fact(text: str, qa: SceneQA | None) -> Hashable:
    """What a candidate claims to see: for a scene row the view it states of the question's
    subjects (None if unreadable); for a free-text row the distinct (class, value) attribute words
    the lexicon finds, sorted. Distinct, not counted: a skipped step drops mentions, not facts."""
    if qa is None:
        return tuple(sorted(lexemes(find_mentions(text))))
    view = stated_view(qa, text)
    return None if view is None else tuple(view[i] for i in qa.spec.subjects)


def problem_count(text: str, qa: SceneQA | None) -> int:
    """How many steps or finals of a candidate do not follow from its own stated facts; 0 for a
    free-text row, whose reasoning no rule can check."""
    return 0 if qa is None else len(reasoning_problems(qa, text))


def odd_one_out(facts: Sequence[Hashable]) -> int | None:
    """The index of the one fact that differs while all the others are equal; None when there is
    no such fact. Needs three or more: of two different facts, either one is the odd one."""
    counts = Counter(facts)
    if len(facts) < 3 or len(counts) != 2:
        return None
    odd, n = counts.most_common()[-1]
    return facts.index(odd) if n == 1 else None


@dataclass(frozen=True)
class TextSignals:
    """What the rules read from the candidate texts of one tuple."""

    problems: tuple[int, ...]  # reasoning problems per candidate
    odd: int | None  # the candidate whose stated fact no other candidate shares, where all others agree


def text_signals(candidates: Sequence[str], qa: SceneQA | None = None) -> TextSignals:
    """The signals of a tuple's candidates; `qa` is the scene row's regenerated question (None:
    a free-text row). The odd one out is taken over every candidate, consistent or not: in a
    nested tuple the wrong fact the chosen answer differs from is shared by the inconsistent one."""
    return TextSignals(
        tuple(problem_count(t, qa) for t in candidates), odd_one_out([stated_fact(t, qa) for t in candidates])
    )


def _rule_key(rule: str, signals: TextSignals, candidate: int) -> int:
    """Lower is better: fewer reasoning problems; the odd one out before the others."""
    if rule == "consistency":
        return signals.problems[candidate]
    if rule == "odd_one_out":
        return int(candidate != signals.odd)
    raise ValueError(f"unknown text-only rule {rule!r}; expected consistency or odd_one_out")


def rank(signals: TextSignals, rules: Sequence[str] = RANKERS["combined"]) -> Ranking:
    """Candidates grouped by their keys under `rules` (compared in order), best group first;
    candidates the rules cannot tell apart share a group."""
    keys = [tuple(_rule_key(r, signals, i) for r in rules) for i in range(len(signals.problems))]
    return [[i for i, k in enumerate(keys) if k == key] for key in sorted(set(keys))]


def text_only_ranking(candidates: Sequence[str], qa: SceneQA | None = None) -> Ranking:
    """The combined text-only ranker of one tuple: consistency first, then the odd one out among
    candidates equally consistent. `qa`: the scene row's regenerated question, None for free text."""
    return rank(text_signals(candidates, qa))


# --------------------------------------------------------------------------- scoring with ties


def expected_correct_first(ranking: Ranking, order: Sequence[int]) -> Fraction:
    """Chance that the best candidate `order[0]` comes first once each tie is broken uniformly at
    random: 1 / (size of the first group) if it is in the first group, else 0."""
    first = ranking[0]
    return Fraction(1, len(first)) if order[0] in first else Fraction(0)


def expected_exact(ranking: Ranking, order: Sequence[int]) -> Fraction:
    """Chance that breaking each tie uniformly at random gives exactly `order` (best -> worst):
    every group must hold the candidates of its stretch of `order`, and then each group of size g
    comes out right with chance 1/g!."""
    chance, start = Fraction(1), 0
    for group in ranking:
        if set(group) != set(order[start : start + len(group)]):
            return Fraction(0)
        chance /= math.factorial(len(group))
        start += len(group)
    return chance


def chance_scores(num_candidates: int) -> tuple[Fraction, Fraction]:
    """Correct-first and exact accuracy of a ranker that ties everything: 1/K and 1/K!."""
    return Fraction(1, num_candidates), Fraction(1, math.factorial(num_candidates))


# --------------------------------------------------------------------------- the audit


def _kind(meta: Mapping[str, Any]) -> str | None:
    """The question kind of a scene row (`ranked_item` records it in meta, a PPJD row in its scene
    reference); None for free-text rows."""
    return meta.get("kind") or meta.get("scene", {}).get("kind")


@dataclass
class _Tally:
    """Running sums of the per-item scores of a set of items."""

    items: int = 0
    chance_correct_first: Fraction = Fraction(0)
    chance_exact: Fraction = Fraction(0)
    correct_first: dict[str, Fraction] = field(default_factory=lambda: dict.fromkeys(RANKERS, Fraction(0)))
    exact: dict[str, Fraction] = field(default_factory=lambda: dict.fromkeys(RANKERS, Fraction(0)))

    def add(self, signals: TextSignals, order: Sequence[int]) -> None:
        first, exact = chance_scores(len(order))
        self.items += 1
        self.chance_correct_first += first
        self.chance_exact += exact
        for name, rules in RANKERS.items():
            ranking = rank(signals, rules)
            self.correct_first[name] += expected_correct_first(ranking, order)
            self.exact[name] += expected_exact(ranking, order)

    def means(self) -> dict[str, Any]:
        """Mean scores: the combined ranker's at the top, each ranker's under "by_rule"; None
        where there are no items."""

        def mean(total: Fraction) -> float | None:
            return float(total / self.items) if self.items else None

        return {
            "items": self.items,
            "correct_first": mean(self.correct_first["combined"]),
            "exact": mean(self.exact["combined"]),
            "chance_correct_first": mean(self.chance_correct_first),
            "chance_exact": mean(self.chance_exact),
            "by_rule": {
                name: {"correct_first": mean(self.correct_first[name]), "exact": mean(self.exact[name])}
                for name in RANKERS
            },
        }


def audit(items: Iterable[JudgeItem]) -> dict[str, Any]:
    """How well the text-only rankers order `items`, against chance, overall and per question kind
    (`by_kind`, scene rows only). Chance is the mean of 1/K and 1/K! over the items."""
    total, by_kind = _Tally(), dict[str, _Tally]()
    for item in items:
        signals = text_signals(item.candidates, scene_qa(item.meta))
        total.add(signals, item.order)
        kind = _kind(item.meta)
        if kind is not None:
            by_kind.setdefault(kind, _Tally()).add(signals, item.order)
    return {**total.means(), "by_kind": {kind: t.means() for kind, t in sorted(by_kind.items())}}
