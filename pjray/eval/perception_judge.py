"""The Perception-Judge release's evaluation of MLLM-as-a-Judge, reproduced:
`eval.convention=perception_judge`.

Source: kaist-cvml/perception-judge, `eval/evaluate_metric.ipynb`: the Pair, Batch and Score
cells (`calculate_accuracy_metrics`, `calculate_levenshtein_metrics`, `calculate_pearson_metrics`)
and the cells after each that average them over the seed files; the rows they read are written
by `eval/generate_judgment.py` `main`: {text, pred, gt, dataset}, `text` being the whole generated
text (think included, stripped), `gt` the human answer as a string.

Reading a raw text differs from pjray's strict reader (`pjray.reward.parse`) on every point: only
`<answer>N</answer>` blocks holding nothing but decimal digits count, those inside the think text
too (pair: `read_pair`, as Flex-Judge's scripts read it, which the release inherits), and the
score and batch rules are the notebook's (`read_score`, `read_batch`). Metrics per seed file are
the notebook's (`pair_tables`, `score_tables`, `batch_tables`); each number is `np.mean` of its
per-seed values, so one undefined seed (a nan r from a constant prediction list) leaves it
undefined (`metrics.MEAN_IF_ALL`).

The notebook prints the per-dataset values and `overall` (pooled); `dataset_mean` (the mean of
the per-dataset values, undefined if one is) is pjray's addition. Where the notebook stops with
an error (fewer than 2 items for pearsonr, a digit run beyond Python's int() limit) there is no
official number: the value is undefined here and such an output counts as unreadable.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from pjray.eval.flex_judge import answer_integers, read_pair  # the same reading (the release inherits it)
from pjray.eval.metrics import (
    DATASET_MEAN,
    MEAN_IF_ALL,
    OVERALL,
    BatchRecord,
    PairRecord,
    Row,
    ScoreRecord,
    Table,
    batch_distance,
    score_table,
)
from pjray.eval.report import Cell, seed_cells
from pjray.reward.parse import ranking_from_scores

SOURCE = "Perception-Judge (kaist-cvml/perception-judge eval/evaluate_metric.ipynb)"
MIN_BATCH = 3  # batches whose truth has fewer letters are skipped

_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DIGITS_RE = re.compile(r"\d+")

__all__ = ["read_pair", "read_score", "read_batch", "TABLES", "SOURCES"]


# --------------------------------------------------------------------------- reading


def read_score(text: str) -> float | None:
    """ceil(v / 2) of the FIRST answer integer v (`answer_integers`), -1 when that exceeds 5
    (v >= 11), 0 for v = 0; None (counted, then -1) when there is no answer integer
    (`calculate_pearson_metrics`)."""
    v = answer_integers(text)
    if not v:
        return None
    pred = math.ceil(v[0] / 2)
    return -1.0 if pred > 5 else float(pred)


def read_batch(text: str, truth_len: int) -> str | None:
    """The ranking of the first `truth_len` digit runs inside the answer blocks; None (counted,
    then "", which ranks nothing) when there is none (`calculate_levenshtein_metrics`).

    Every run of decimal digits inside every `<answer>...</answer>` block counts (blocks may span
    lines and hold any text: "Assistant 1: 8" gives 1 and 8, "7.5" gives 7 and 5, "-3" gives 3,
    " 8 " gives 8), flattened in order, then ranked highest first with ties to the later letter."""
    try:
        v = [int(d) for block in _ANSWER_BLOCK_RE.findall(text) for d in _DIGITS_RE.findall(block)]
    except ValueError:  # beyond Python's int() limit: the notebook stops there
        return None
    v = v[:truth_len]
    return ranking_from_scores(tuple(v)) if v else None


# --------------------------------------------------------------------------- per seed


def _by_dataset(records: Iterable) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in records:
        out.setdefault(r.dataset, []).append(r)
    return out


def _pooled(groups: dict[str, list]) -> list:
    """The notebook pools by extending dataset after dataset (first-seen order)."""
    return [r for rows in groups.values() for r in rows]


def _pair_row(rows: Sequence[PairRecord], with_ties: bool) -> Row:
    kept = [r for r in rows if with_ties or r.truth != "C"]
    correct = sum((r.pred or "C") == r.truth for r in kept)
    return Row(
        value=correct / len(kept) if kept else None,
        n=len(kept),
        unparsed=sum(r.pred is None for r in rows),
        skipped=len(rows) - len(kept),
    )


def _pair_table(records: Sequence[PairRecord], with_ties: bool) -> Table:
    groups = _by_dataset(records)
    table = {name: _pair_row(rows, with_ties) for name, rows in groups.items()}
    table[OVERALL] = _pair_row(_pooled(groups), with_ties)
    return table


def _batch_row(rows: Sequence[BatchRecord]) -> Row:
    kept = [r for r in rows if len(r.truth) >= MIN_BATCH]
    distances = [batch_distance(r.pred, r.truth, normalized=True) for r in kept]
    return Row(
        value=float(np.mean(distances)) if distances else None,
        n=len(distances),
        unparsed=sum(r.pred is None for r in rows),
        skipped=len(rows) - len(kept),
    )


def _batch_table(records: Sequence[BatchRecord]) -> Table:
    groups = _by_dataset(records)
    table = {name: _batch_row(rows) for name, rows in groups.items()}
    table[OVERALL] = _batch_row(_pooled(groups))
    return table


def _score_table(records: Sequence[ScoreRecord]) -> Table:
    return score_table(_pooled(_by_dataset(records)), unparsed="minus_one")


# --------------------------------------------------------------------------- over seeds


def _over_seeds(per_seed_tables: list[Table]) -> dict[str, Cell]:
    """np.mean over the seeds per row; then pjray's dataset_mean of the per-dataset values."""
    cells = seed_cells(per_seed_tables, MEAN_IF_ALL)
    datasets = [c for name, c in cells.items() if name != OVERALL]
    values = [c.value for c in datasets]
    cells[DATASET_MEAN] = Cell(
        value=float(np.mean(values)) if values and None not in values else None,  # type: ignore[arg-type]
        n=sum(c.n for c in datasets),
        unparsed=sum(c.unparsed for c in datasets),
        skipped=sum(c.skipped for c in datasets),
    )
    return cells


def pair_tables(per_seed: Sequence[Sequence[PairRecord]]) -> dict[str, dict[str, Cell]]:
    """Accuracy per dataset and pooled, with ties (every item) and without (true ties skipped; a
    predicted C is wrong); each the mean over the seeds."""
    return {
        "acc_with_tie": _over_seeds([_pair_table(records, True) for records in per_seed]),
        "acc_without_tie": _over_seeds([_pair_table(records, False) for records in per_seed]),
    }


def score_tables(per_seed: Sequence[Sequence[ScoreRecord]]) -> dict[str, dict[str, Cell]]:
    """scipy pearsonr of the predictions and int(gt), per dataset and pooled; the mean over seeds."""
    return {"pearson": _over_seeds([_score_table(records) for records in per_seed])}


def batch_tables(per_seed: Sequence[Sequence[BatchRecord]]) -> dict[str, dict[str, Cell]]:
    """Levenshtein(pred, truth) / max(len(pred), len(truth)), the normalised distance only, mean
    per dataset and pooled; items whose truth has at most 2 letters are skipped (a dataset left
    empty is nan); the mean over the seeds."""
    return {"levenshtein_norm": _over_seeds([_batch_table(records) for records in per_seed])}


TABLES = {"pair": pair_tables, "score": score_tables, "batch": batch_tables}

SOURCES = {
    "acc_with_tie": f"{SOURCE} calculate_accuracy_metrics(include_ties=True): first two <answer>N</answer> "
    "anywhere (fewer: C); per seed, then np.mean over seeds",
    "acc_without_tie": f"{SOURCE} calculate_accuracy_metrics(include_ties=False): true ties skipped, a predicted "
    "C is wrong; np.mean over seeds",
    "pearson": f"{SOURCE} calculate_pearson_metrics: ceil(v/2) of the first <answer>N</answer> (none or > 5: -1); "
    "pearsonr per seed, np.mean over seeds (undefined if one seed is)",
    "levenshtein_norm": f"{SOURCE} calculate_levenshtein_metrics: digits in the <answer> blocks cut to len(truth); "
    "Levenshtein/max(len); truths of <= 2 letters skipped; np.mean over seeds",
    OVERALL: f"{SOURCE}: pooled over the items of all datasets, per seed",
    DATASET_MEAN: "pjray: mean of the per-dataset values above (undefined if one is); the notebook does not print it",
}
