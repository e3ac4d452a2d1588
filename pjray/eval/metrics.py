"""Pure metric functions for judge evaluation: no I/O, no models, no Ray.

MLLM-as-a-Judge (Dongping-Chen/MLLM-Judge, `scripts/calculate_metrics.ipynb`), each metric per
`original_dataset` and pooled: score, Pearson r (`score_table`); pair, accuracy with and without
ties (`pair_accuracy`: the official no-tie rule skips true and predicted ties, the downstream one
of Flex-Judge and Perception-Judge true ties only); batch, the Levenshtein distance of the
ranking strings, raw (official) or normalised by max(len) (the papers' tables; `batch_distance`).
Averages over datasets: `overall` is the notebook's pooled value, `dataset_mean` the mean of the
defined per-dataset values (`with_dataset_mean`), `paper_mean` the paper's own (`with_paper_mean`).

pjray's own options on top (the official behaviour is every default): `score_table(...,
unparsed="minus_one")` keeps an unreadable score as -1 in r, as both release scripts do;
`majority_verdict` / `vote_pairs` vote pair verdicts by plurality over seeds (pjray's rule, not
Flex-Judge's). The release scripts end to end, reading included, are `pjray.eval.perception_judge`
and `pjray.eval.flex_judge`.

MM-JudgeBias (naver-ai/MM-JudgeBias, `mm_judgebias/metrics.py`, `evaluate.py`), scores on 1..S
(S = MAX_SCORE = 10): BD (`bias_deviation`) and BC (`bias_conformity`), pairs with a None score
dropped and counted; `bias_metric` / `bias_summary` give the official report
(`evaluate.compute_report`) or pjray's strict one (see BIAS_CONVENTIONS). The perceptual-judgment
bias diagnosis (the paper's Mode a / Mode b): `mode_rates`. Paired exact McNemar tests:
`paired_test`, `paired_verdicts`. Unreadable judge outputs are never dropped silently: every
function that drops or penalises them returns how many there were.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import Levenshtein
import numpy as np

OVERALL = "overall"  # the pooled row of every per-dataset table

TIE_RULES = ("official", "downstream")
SEED_AGGREGATIONS = ("mean", "median")  # eval.seed_agg
MEAN_IF_ALL = "mean_if_all"  # numpy's mean over every seed: undefined when one seed is (Perception-Judge)
UNPARSED_SCORES = ("drop", "minus_one")  # score protocol: drop unreadable scores | keep them as -1
PAIR_VOTES = ("none", "majority")  # pair protocol: per-seed accuracy | accuracy of the seeds' plurality
UNPARSED_SCORE_VALUE = -1.0  # the release scripts' stand-in prediction for an unreadable score
BIAS_CONVENTIONS = ("official", "strict")  # MM-JudgeBias report: evaluate.py's | pjray's

BD_TYPES: tuple[str, ...] = (
    "text_dominance",
    "image_dominance",
    "response_dominance",
    "instruction_misalignment",
    "image_misalignment",
)
BC_TYPES: tuple[str, ...] = (
    "detail_description",
    "unnecessary_image",
    "visual_transformation",
    "texture_insertion",
)
BIAS_TYPES: tuple[str, ...] = BD_TYPES + BC_TYPES
CATEGORIES: dict[str, tuple[str, ...]] = {
    "Integrality": ("text_dominance", "image_dominance", "response_dominance"),
    "Congruity": ("instruction_misalignment", "image_misalignment"),
    "Robustness": BC_TYPES,
}
MAX_SCORE = 10  # MM-JudgeBias scores on 1..S


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ScoreRecord:
    """One judged score item: the judge's score on the benchmark's scale (None: unreadable)."""

    dataset: str
    pred: float | None
    human: float


@dataclass(frozen=True)
class PairRecord:
    """One judged pair: verdicts are "A", "B" or "C" (tie); pred None: unreadable."""

    dataset: str
    pred: str | None
    truth: str


@dataclass(frozen=True)
class BatchRecord:
    """One judged batch: ranking strings best -> worst ("CDAB"); pred None: unreadable."""

    dataset: str
    pred: str | None
    truth: str


@dataclass(frozen=True)
class Row:
    """One row of a per-dataset table: the metric value (None: undefined) over n items."""

    value: float | None
    n: int  # items that entered the metric
    unparsed: int = 0  # unreadable judge outputs among this dataset's items
    skipped: int = 0  # items left out by the rule (ties, None scores)


Table = dict[str, Row]  # dataset -> row, plus OVERALL


# --------------------------------------------------------------------------- score protocol


def pearson(pred: Sequence[float], human: Sequence[float]) -> float | None:
    """Pearson r as scipy.stats.pearsonr computes it; None when undefined (n < 2 or a constant
    input, where scipy returns nan with a warning)."""
    if len(pred) != len(human):
        raise ValueError(f"pearson: {len(pred)} predictions but {len(human)} human scores")
    if len(pred) < 2:
        return None
    x, y = np.asarray(pred, dtype=float), np.asarray(human, dtype=float)
    if np.all(x == x[0]) or np.all(y == y[0]):
        return None
    from scipy.stats import pearsonr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = float(pearsonr(x, y)[0])
    return None if math.isnan(r) else r


def map_score(value: float | None, mapping: str) -> float | None:
    """Judge score -> benchmark scale. `ceil_half`: 1-10 -> 1-5 as ceil(v / 2) (Perception-Judge's
    evaluation); `none`: unchanged (a judge prompted on the benchmark's own 1-5 scale)."""
    if value is None:
        return None
    if mapping == "none":
        return float(value)
    if mapping == "ceil_half":
        return float(math.ceil(value / 2))
    raise ValueError(f"unknown score mapping {mapping!r}; expected ceil_half or none")


def score_table(records: Iterable[ScoreRecord], unparsed: str = "drop") -> Table:
    """Pearson r per dataset and pooled.

    Unreadable scores are counted (`Row.unparsed`) under both rules. `drop` (default) leaves
    them out of r. `minus_one` keeps them with prediction -1, as both release scripts do
    (Flex-Judge `test/evaluate.py` `mllm_judge_eval`, Perception-Judge `calculate_pearson_metrics`):
    a judge that fails to answer is then penalised through r instead of being scored only on
    the items it could read, so `n` counts them.
    """
    if unparsed not in UNPARSED_SCORES:
        raise ValueError(f"unknown unparsed-score rule {unparsed!r}; expected one of {UNPARSED_SCORES}")
    groups = _by_dataset(records)
    table: Table = {}
    for name, rows in groups.items():
        if unparsed == "minus_one":
            pairs = [(UNPARSED_SCORE_VALUE if r.pred is None else r.pred, r.human) for r in rows]
        else:
            pairs = [(r.pred, r.human) for r in rows if r.pred is not None]
        table[name] = Row(
            value=pearson([p for p, _ in pairs], [h for _, h in pairs]),
            n=len(pairs),
            unparsed=sum(r.pred is None for r in rows),
        )
    return table


DATASET_MEAN = "dataset_mean"  # the unweighted mean over the datasets with a value
PAPER_MEAN = "paper_mean"  # the MLLM-as-a-Judge paper's average: sum over datasets / their number
SUMMARY_ROWS = (OVERALL, DATASET_MEAN, PAPER_MEAN)


def with_dataset_mean(table: Table) -> Table:
    """Add the mean of the per-dataset values (defined ones only) as row DATASET_MEAN.

    The official notebook reports the pooled value (OVERALL); the downstream papers average
    the per-dataset values, so both are reported.
    """
    rows = [r for name, r in table.items() if name not in SUMMARY_ROWS]
    values = [r.value for r in rows if r.value is not None]
    out = dict(table)
    out[DATASET_MEAN] = Row(
        value=sum(values) / len(values) if values else None,
        n=sum(r.n for r in rows),
        unparsed=sum(r.unparsed for r in rows),
        skipped=sum(r.skipped for r in rows),
    )
    return out


def with_paper_mean(table: Table) -> Table:
    """Add the MLLM-as-a-Judge paper's average over datasets as row PAPER_MEAN.

    The paper's analysis notebooks (`scripts/Score_analysis.ipynb`, `scripts/pair_analysis.ipynb`)
    add up the per-dataset values and divide by the number of datasets: a dataset without items
    ("No data") adds 0 but still counts, and an undefined value (a constant prediction, where
    pearsonr gives nan; fewer than 2 items, where it fails) leaves the average undefined.
    Unlike DATASET_MEAN, which averages the defined values only.
    """
    rows = [r for name, r in table.items() if name not in SUMMARY_ROWS]
    if any(r.value is None and r.n > 0 for r in rows) or not rows:
        value = None
    else:
        value = sum(r.value if r.value is not None else 0.0 for r in rows) / len(rows)
    out = dict(table)
    out[PAPER_MEAN] = Row(
        value=value,
        n=sum(r.n for r in rows),
        unparsed=sum(r.unparsed for r in rows),
        skipped=sum(r.skipped for r in rows),
    )
    return out


# --------------------------------------------------------------------------- pair protocol


def pair_accuracy(records: Sequence[PairRecord], with_ties: bool, tie_rule: str = "official") -> Row:
    """Accuracy of pair verdicts.

    with_ties=True: every item counts. with_ties=False: `official` skips items whose truth or
    prediction is "C"; `downstream` (Flex-Judge, Perception-Judge) skips items whose truth is "C"
    only, so a predicted tie counts as wrong. An unreadable verdict
    (None) is never a tie, so it stays in and counts as wrong under both rules.
    """
    if tie_rule not in TIE_RULES:
        raise ValueError(f"unknown tie rule {tie_rule!r}; expected one of {TIE_RULES}")
    kept = []
    for r in records:
        if not with_ties and (r.truth == "C" or (tie_rule == "official" and r.pred == "C")):
            continue
        kept.append(r)
    correct = sum(r.pred == r.truth for r in kept)
    return Row(
        value=correct / len(kept) if kept else None,
        n=len(kept),
        unparsed=sum(r.pred is None for r in records),
        skipped=len(records) - len(kept),
    )


def pair_table(records: Iterable[PairRecord], with_ties: bool, tie_rule: str = "official") -> Table:
    """`pair_accuracy` per dataset and pooled."""
    return {name: pair_accuracy(rows, with_ties, tie_rule) for name, rows in _by_dataset(records).items()}


def majority_verdict(verdicts: Sequence[str | None]) -> str | None:
    """The most common of one item's per-seed verdicts (`eval.pair_vote=majority`).

    pjray's own rule: Flex-Judge's script votes differently (the sign of the sum of A = -1,
    B = +1, C = 0, see `pjray.eval.flex_judge.sign_vote`); the two agree when every seed
    answered A or B and the number of seeds is odd.

    An unreadable verdict (None) is a vote like any other, so an item most seeds could not
    read stays unreadable (and counts as wrong) instead of being decided by one lucky seed.
    Ties between equally common verdicts go to the one given first in seed order, i.e. the
    first seed's verdict whenever it is among the tied ones (always so with 2 or 3 seeds).
    """
    if not verdicts:
        raise ValueError("majority_verdict: no verdicts")
    counts: dict[str | None, int] = {}
    for v in verdicts:  # dicts keep first-seen order, which is the tie-break
        counts[v] = counts.get(v, 0) + 1
    top = max(counts.values())
    return next(v for v, c in counts.items() if c == top)


def vote_pairs(per_seed: Sequence[Sequence[PairRecord]]) -> list[PairRecord]:
    """One record per item whose verdict is the `majority_verdict` over the seeds.

    `per_seed[s][i]` is item i judged under seed s; every seed must list the same items in the
    same order (same dataset and truth), as the evaluation loop produces them.
    """
    if not per_seed:
        raise ValueError("vote_pairs: no seeds")
    n = len(per_seed[0])
    if any(len(records) != n for records in per_seed):
        raise ValueError(f"vote_pairs: seeds judged different numbers of items {[len(r) for r in per_seed]}")
    voted = []
    for i in range(n):
        items = [records[i] for records in per_seed]
        first = items[0]
        if any((r.dataset, r.truth) != (first.dataset, first.truth) for r in items):
            raise ValueError(f"vote_pairs: item {i} differs between seeds ({first.dataset}, {first.truth})")
        voted.append(PairRecord(first.dataset, majority_verdict([r.pred for r in items]), first.truth))
    return voted


# --------------------------------------------------------------------------- batch protocol


def batch_distance(pred: str | None, truth: str, normalized: bool) -> float:
    """Levenshtein distance of the ranking strings, raw (the official notebook) or `normalized` by
    max(len(pred), len(truth)) (the papers' tables, the downstream evaluations); an unreadable
    prediction is the empty string (distance len(truth), normalised 1.0): penalised, not dropped."""
    p = pred or ""
    d = Levenshtein.distance(p, truth)
    if not normalized:
        return float(d)
    longest = max(len(p), len(truth))
    return d / longest if longest else 0.0


def batch_table(records: Iterable[BatchRecord], normalized: bool) -> Table:
    """Mean Levenshtein distance per dataset and pooled (lower is better), every item counted."""
    table: Table = {}
    for name, rows in _by_dataset(records).items():
        ds = [batch_distance(r.pred, r.truth, normalized) for r in rows]
        table[name] = Row(
            value=sum(ds) / len(ds) if ds else None,
            n=len(ds),
            unparsed=sum(r.pred is None for r in rows),
        )
    return table


# --------------------------------------------------------------------------- MM-JudgeBias


@dataclass(frozen=True)
class BiasValue:
    """One bias type's BD or BC over its pairs; None when no pair entered the mean."""

    value: float | None
    n: int  # pairs that entered the mean
    dropped_none: int  # pairs dropped because a score was None
    skipped: int = 0  # BD: usable pairs with y <= 1 (no room to drop)


def bias_deviation(pairs: Sequence[tuple[float | None, float | None]]) -> BiasValue:
    """BD (Bias-Deviation) over (y, yhat) pairs: mean of max(0, y - yhat) / (y - 1) over the
    pairs with y > 1; None when there is none (`bias_metric` gives the official 0.0 there).

    The test is written `not y <= 1`, as `mm_judgebias/metrics.py` `bias_deviation` skips
    `y <= 1`: the official parser can read "nan", and a nan y must enter the mean here too.
    """
    usable = [(y, yh) for y, yh in pairs if y is not None and yh is not None]
    values = [max(0.0, y - yh) / (y - 1) for y, yh in usable if not y <= 1]
    return BiasValue(
        value=sum(values) / len(values) if values else None,
        n=len(values),
        dropped_none=len(pairs) - len(usable),
        skipped=len(usable) - len(values),
    )


def bias_conformity(pairs: Sequence[tuple[float | None, float | None]], max_score: float = MAX_SCORE) -> BiasValue:
    """BC (Bias-Conformity) over (y, yhat) pairs: mean of 1 - |y - yhat| / max(y - 1, S - y),
    1.0 where that denominator is not > 0 (`mm_judgebias/metrics.py` `bias_conformity`)."""
    usable = [(y, yh) for y, yh in pairs if y is not None and yh is not None]
    values = []
    for y, yh in usable:
        denom = max(y - 1, max_score - y)
        values.append(1.0 - abs(y - yh) / denom if denom > 0 else 1.0)
    return BiasValue(
        value=sum(values) / len(values) if values else None,
        n=len(values),
        dropped_none=len(pairs) - len(usable),
    )


def bias_metric(
    bias_type: str,
    pairs: Sequence[tuple[float | None, float | None]],
    convention: str = "official",
    max_score: float = MAX_SCORE,
) -> BiasValue:
    """BD for the five dominance/misalignment types, BC for the four robustness types.

    `official` (`evaluate.py` `compute_report`): a type with usable pairs always has a value, so
    BD is 0.0 when every unbiased score is at the floor (y <= 1). `strict` (pjray): BD is then
    undefined (None), since no pair could show a deviation.
    """
    if convention not in BIAS_CONVENTIONS:
        raise ValueError(f"unknown MM-JudgeBias convention {convention!r}; expected one of {BIAS_CONVENTIONS}")
    if bias_type in BD_TYPES:
        v = bias_deviation(pairs)
    elif bias_type in BC_TYPES:
        v = bias_conformity(pairs, max_score)
    else:
        raise ValueError(f"unknown bias type {bias_type!r}; expected one of {BIAS_TYPES}")
    if convention == "official" and v.value is None and v.n + v.skipped > 0:
        v = BiasValue(0.0, v.n, v.dropped_none, v.skipped)
    return v


def bias_summary(per_type: Mapping[str, float | None], convention: str = "official") -> dict[str, float | None]:
    """Category means and the overall mean of the per-bias values.

    `official` (`evaluate.py` `compute_report`): each is the mean over the bias types that have a
    value (a missing or None type is skipped), None only when none has. `strict` (pjray): None
    as soon as one of its types is missing or None, since a mean over a subset of the types is
    not comparable with one over all of them.
    """
    if convention not in BIAS_CONVENTIONS:
        raise ValueError(f"unknown MM-JudgeBias convention {convention!r}; expected one of {BIAS_CONVENTIONS}")

    def mean(types: Sequence[str]) -> float | None:
        vals = [per_type.get(t) for t in types]
        present = [v for v in vals if v is not None]
        if convention == "strict" and len(present) < len(vals):
            return None
        return sum(present) / len(present) if present else None

    out = {category: mean(types) for category, types in CATEGORIES.items()}
    out[OVERALL] = mean(BIAS_TYPES)
    return out


# --------------------------------------------------------------------------- Mode a / Mode b


@dataclass(frozen=True)
class ModeRecord:
    """One diagnosis item: the judge's scores of the correct and the perceptually wrong answer
    (None: unreadable) and whether its own probe answer was right (None: unreadable)."""

    correct_score: float | None
    wrong_score: float | None
    probe_ok: bool | None


@dataclass(frozen=True)
class ModeRates:
    """Rates over the n items whose two scores were readable; mode_a + mode_b + unattributed
    = error rate. `unattributed`: errors whose probe answer could not be read."""

    error_rate: float | None
    mode_a_rate: float | None
    mode_b_rate: float | None
    unattributed_rate: float | None
    probe_accuracy: float | None  # over items with a readable probe answer
    n: int
    errors: int
    mode_a: int
    mode_b: int
    unattributed: int
    unparsed_scores: int  # items dropped because a score was unreadable
    unparsed_probes: int  # items whose probe answer was unreadable (kept for the error rate)


def mode_rates(records: Sequence[ModeRecord]) -> ModeRates:
    """A perceptual judgment error is wrong_score >= correct_score. Split by the judge's probe:
    wrong probe -> Mode (a) insufficient perception; right probe -> Mode (b) response-anchored
    judgment. Items with an unreadable score are dropped from the rates and counted."""
    scored = [r for r in records if r.correct_score is not None and r.wrong_score is not None]
    errors = [r for r in scored if r.wrong_score >= r.correct_score]  # type: ignore[operator]
    a = sum(r.probe_ok is False for r in errors)
    b = sum(r.probe_ok is True for r in errors)
    u = len(errors) - a - b
    probed = [r for r in records if r.probe_ok is not None]
    n = len(scored)

    def rate(k: int) -> float | None:
        return k / n if n else None

    return ModeRates(
        error_rate=rate(len(errors)),
        mode_a_rate=rate(a),
        mode_b_rate=rate(b),
        unattributed_rate=rate(u),
        probe_accuracy=sum(bool(r.probe_ok) for r in probed) / len(probed) if probed else None,
        n=n,
        errors=len(errors),
        mode_a=a,
        mode_b=b,
        unattributed=u,
        unparsed_scores=len(records) - n,
        unparsed_probes=sum(r.probe_ok is None for r in records),
    )


# --------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class SeedAggregate:
    value: float | None  # mean or median over the seeds where the metric was defined
    std: float | None  # population std over those seeds (None with fewer than 2)
    per_seed: tuple[float | None, ...] = field(default=())


def aggregate_seeds(values: Sequence[float | None], how: str = "mean") -> SeedAggregate:
    """Aggregate one metric over seeds.

    `mean` / `median` (eval.seed_agg): over the seeds where the metric is defined (None seeds
    are left out). MEAN_IF_ALL: numpy's mean over every seed, undefined as soon as one seed is,
    as the Perception-Judge notebook's `np.mean` over the seeds' values (a nan stays nan).
    """
    if how not in SEED_AGGREGATIONS + (MEAN_IF_ALL,):
        raise ValueError(f"unknown seed aggregation {how!r}; expected one of {SEED_AGGREGATIONS + (MEAN_IF_ALL,)}")
    defined = [v for v in values if v is not None]
    if not defined or (how == MEAN_IF_ALL and len(defined) < len(values)):
        return SeedAggregate(None, None, tuple(values))
    if how == MEAN_IF_ALL:
        value = float(np.mean(defined))
    else:
        value = statistics.fmean(defined) if how == "mean" else float(statistics.median(defined))
    std = statistics.pstdev(defined) if len(defined) > 1 else None
    return SeedAggregate(value, std, tuple(values))


def _by_dataset(records: Iterable) -> dict[str, list]:
    """Records grouped by dataset (first-seen order), plus every record under OVERALL."""
    groups: dict[str, list] = defaultdict(list)
    pooled = []
    for r in records:
        groups[r.dataset].append(r)
        pooled.append(r)
    reserved = [name for name in SUMMARY_ROWS if name in groups]
    if reserved:
        raise ValueError(f"a dataset may not be named {reserved[0]!r}: {SUMMARY_ROWS} are summary rows")
    out = dict(groups)
    out[OVERALL] = pooled
    return out


# --------------------------------------------------------------------------- paired tests


@dataclass(frozen=True)
class PairedTest:
    """Two judgments of the same items (two judges, or one judge on two images), item by item.

    `b`: right under the first and wrong under the second; `c`: the reverse. The exact McNemar
    test asks whether b and c differ more than a fair coin over the b + c discordant items
    would make them (the concordant items say nothing about a difference)."""

    n: int  # items judged under both
    accuracy_first: float | None
    accuracy_second: float | None
    b: int
    c: int
    p_value: float  # exact two-sided McNemar

    @property
    def difference(self) -> float | None:
        if self.accuracy_first is None or self.accuracy_second is None:
            return None
        return self.accuracy_first - self.accuracy_second


def mcnemar_exact(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value: P(|X - n/2| >= |b - n/2|) for X ~ Binomial(n = b + c,
    1/2), i.e. min(1, 2 * P(X <= min(b, c))); 1.0 without discordant items."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_test(first: Sequence[bool], second: Sequence[bool]) -> PairedTest:
    """`PairedTest` of per-item correctness under two judgments of the same items (same order)."""
    if len(first) != len(second):
        raise ValueError(f"paired verdicts of different lengths: {len(first)} and {len(second)}")
    n = len(first)
    b = sum(1 for x, y in zip(first, second) if x and not y)
    c = sum(1 for x, y in zip(first, second) if y and not x)
    return PairedTest(
        n=n,
        accuracy_first=sum(map(bool, first)) / n if n else None,
        accuracy_second=sum(map(bool, second)) / n if n else None,
        b=b,
        c=c,
        p_value=mcnemar_exact(b, c),
    )


def paired_verdicts(first: dict[int, dict[str, Any]], second: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The paired exact McNemar test per group and pooled, over the rows judged under both;
    `first` and `second` map a row index to its verdict {group, right} (`EvalReport.items`)."""
    common = sorted(set(first) & set(second))
    groups = list(dict.fromkeys(first[i]["group"] for i in common))
    out = []
    for group in [*groups, OVERALL]:
        these = [i for i in common if group in (OVERALL, first[i]["group"])]
        t = paired_test([bool(first[i]["right"]) for i in these], [bool(second[i]["right"]) for i in these])
        out.append(
            {
                "group": group,
                "n": t.n,
                "accuracy_first": t.accuracy_first,
                "accuracy_second": t.accuracy_second,
                "b": t.b,
                "c": t.c,
                "p_value": t.p_value,
            }
        )
    return out
