"""Flex-Judge's evaluation of MLLM-as-a-Judge, reproduced: `eval.convention=flex_judge`.

Source: jongwooko/flex-judge, `test/evaluate.py` `mllm_judge_eval` (the numbers it prints), fed by
`test/mllm_as_a_judge_vllm.py` `main` (which writes each seed's {text, pred} rows: `pred` is the
pair verdict, `text` the whole generated text, think included, stripped).

Reading a raw text: only `<answer>N</answer>` blocks holding nothing but decimal digits count,
those inside the think text too (`answer_integers`); pair, score and batch verdicts come from
them as the scripts read them (`read_pair`, `read_score`, `read_batch`). Across seeds (the script
reads the files of seeds 0, 1, 2 in that order) its aggregation is reproduced as it is: pair
verdicts voted by sign (`sign_vote`), score and batch values on pools that grow seed after seed,
then the median (score) or the maximum (batch) over seeds (`pair_tables`, `score_tables`,
`batch_tables`).

The script prints per-dataset values and "Ave" (here `dataset_mean`, `_ave`); it has no pooled row.
Where the script stops with an error (fewer than 2 items in a dataset for pearsonr, a dataset
with only true ties in the no-tie accuracy, a digit run beyond Python's int() limit) there is no
official number: the value is undefined here, and such an output counts as unreadable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pjray.eval.metrics import (
    DATASET_MEAN,
    UNPARSED_SCORE_VALUE,
    BatchRecord,
    PairRecord,
    Row,
    ScoreRecord,
    batch_distance,
    pearson,
)
from pjray.eval.report import Cell, seed_cells
from pjray.reward.parse import ranking_from_scores

SOURCE = "Flex-Judge (jongwooko/flex-judge test/evaluate.py mllm_judge_eval)"

_ANSWER_INT_RE = re.compile(r"<answer>(\d+)</answer>")
_VOTE = {"A": -1, "B": 1, "C": 0}


# --------------------------------------------------------------------------- reading


def answer_integers(text: str) -> list[int] | None:
    """The integers of every `<answer>N</answer>` in the text, in order; None when one has
    more digits than Python's int() accepts (the scripts stop with an error there).

    N is a run of decimal digits and nothing else between the tags: no whitespace, sign,
    decimal point or label; Python's `\\d` and `int` also take non-ASCII decimal digits, so "٧"
    is 7. Every such block in the text counts, those inside the think text too."""
    try:
        return [int(digits) for digits in _ANSWER_INT_RE.findall(text)]
    except ValueError:
        return None


def read_pair(text: str) -> str | None:
    """A / B / C from the first two answer integers: A if the first is larger, B if smaller, C if
    equal; None (counted, then C) when there are fewer: the generation script writes C for an
    unreadable verdict, a predicted tie, which is right on a true tie."""
    v = answer_integers(text)
    if v is None or len(v) < 2:
        return None
    return "A" if v[0] > v[1] else "B" if v[0] < v[1] else "C"


def read_score(text: str) -> float | None:
    """The first answer integer as it is, on the judge's own scale (the script's prompt asks for
    1-5 and maps nothing; out-of-range and zero scores are kept); None (counted, then -1) when
    there is none."""
    v = answer_integers(text)
    return float(v[0]) if v else None


def read_batch(text: str) -> str | None:
    """All answer integers ranked highest first (ties to the later letter); None (counted, then
    "") when there is none."""
    v = answer_integers(text)
    return ranking_from_scores(tuple(v)) if v else None


# --------------------------------------------------------------------------- across seeds


def sign_vote(verdicts: Sequence[str | None]) -> str:
    """The sign of the sum of A = -1, B = +1, C = 0 (an unreadable verdict is C) over seeds."""
    total = sum(_VOTE[v or "C"] for v in verdicts)
    return "A" if total < 0 else "B" if total > 0 else "C"


def _items(per_seed: Sequence[Sequence], what: str) -> list[tuple]:
    """Item i's records over the seeds; every seed must list the same items (same dataset and
    truth) in the same order, as the evaluation loop produces them."""
    if not per_seed:
        raise ValueError(f"{what}: no seeds")
    n = len(per_seed[0])
    if any(len(records) != n for records in per_seed):
        raise ValueError(f"{what}: seeds judged different numbers of items {[len(r) for r in per_seed]}")
    items = list(zip(*per_seed))
    for i, item in enumerate(items):
        if any(replace(r, pred=None) != replace(item[0], pred=None) for r in item):
            raise ValueError(f"{what}: item {i} differs between seeds ({item[0].dataset})")
    return items


def _datasets(items: Sequence[tuple]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for item in items:
        out.setdefault(item[0].dataset, []).append(item)
    return out


def _ave(rows: dict[str, Row], rounded: bool = False) -> Row:
    """The script's "Ave": the mean over datasets, each value first rounded to 3 decimals where
    the script rounds it (pair); undefined if one is undefined. Its score and batch "Ave" add the
    datasets up in the order of a Python set of their names, which changes with string hashing;
    here they are added in name order (as its pair "Ave" does), so those two can differ from a
    given run of the script in the last bit."""
    values = [rows[name].value for name in sorted(rows)]
    defined = None not in values and bool(values)
    if defined and rounded:
        values = [round(v, 3) for v in values]  # type: ignore[arg-type]
    return Row(
        value=sum(values) / len(values) if defined else None,  # type: ignore[arg-type]
        n=sum(r.n for r in rows.values()),
        unparsed=sum(r.unparsed for r in rows.values()),
        skipped=sum(r.skipped for r in rows.values()),
    )


def _cells(rows: dict[str, Row]) -> dict[str, Cell]:
    return seed_cells([rows], "mean")  # one column: the seeds are combined item by item


def pair_tables(per_seed: Sequence[Sequence[PairRecord]]) -> dict[str, dict[str, Cell]]:
    """Accuracy with and without ties of the sign-voted verdicts, per dataset, and "Ave": each
    item's verdict is `sign_vote` over the seeds; with ties every item counts, without them true
    ties are skipped and a predicted C is wrong. "Ave" is the mean of the per-dataset accuracies
    each rounded to 3 decimals."""
    items = _items(per_seed, "flex_judge pair")
    tables = {}
    for name, with_ties in (("acc_with_tie", True), ("acc_without_tie", False)):
        rows: dict[str, Row] = {}
        for dataset, group in _datasets(items).items():
            kept = [item for item in group if with_ties or item[0].truth != "C"]
            correct = sum(sign_vote([r.pred for r in item]) == item[0].truth for item in kept)
            rows[dataset] = Row(
                value=correct / len(kept) if kept else None,
                n=len(kept),
                unparsed=sum(r.pred is None for item in group for r in item),
                skipped=len(group) - len(kept),
            )
        rows[DATASET_MEAN] = _ave(rows, rounded=True)
        tables[name] = _cells(rows)
    return tables


def score_tables(per_seed: Sequence[Sequence[ScoreRecord]]) -> dict[str, dict[str, Cell]]:
    """Median over seeds of Pearson r on the growing pools, per dataset, and "Ave": the script
    never resets its prediction and human lists between seeds, so seed k's r is taken over the
    items of seeds 0..k together; a nan r (a constant list) counts as 0."""
    items = _items(per_seed, "flex_judge score")
    rows: dict[str, Row] = {}
    for dataset, group in _datasets(items).items():
        preds: list[float] = []
        humans: list[float] = []
        rs: list[float | None] = []
        for s in range(len(per_seed)):
            preds += [UNPARSED_SCORE_VALUE if item[s].pred is None else item[s].pred for item in group]
            humans += [item[s].human for item in group]
            r = pearson(preds, humans)
            rs.append(0.0 if r is None and len(preds) >= 2 else r)  # nan (constant input) -> 0
        rows[dataset] = Row(
            value=float(np.median(rs)) if None not in rs else None,  # type: ignore[arg-type]
            n=len(preds),
            unparsed=sum(r.pred is None for item in group for r in item),
        )
    rows[DATASET_MEAN] = _ave(rows)
    return {"pearson": _cells(rows)}


def batch_tables(per_seed: Sequence[Sequence[BatchRecord]]) -> dict[str, dict[str, Cell]]:
    """Maximum over seeds of the mean normalised distance on the growing pools, and "Ave": the
    distances pile up as the scores do, seed k's value is the mean over seeds 0..k, and each
    dataset's value is the MAXIMUM of those means (the script's `np.max`). Distances are
    Levenshtein / max(len(pred), len(truth)), nothing skipped."""
    items = _items(per_seed, "flex_judge batch")
    rows: dict[str, Row] = {}
    for dataset, group in _datasets(items).items():
        distances: list[float] = []
        means = []
        for s in range(len(per_seed)):
            distances += [batch_distance(item[s].pred, item[s].truth, normalized=True) for item in group]
            means.append(np.mean(distances))
        rows[dataset] = Row(
            value=float(np.max(means)),
            n=len(distances),
            unparsed=sum(r.pred is None for item in group for r in item),
        )
    rows[DATASET_MEAN] = _ave(rows)
    return {"levenshtein_norm": _cells(rows)}


TABLES = {"pair": pair_tables, "score": score_tables, "batch": batch_tables}

SOURCES = {
    "acc_with_tie": f"{SOURCE}: per-item sign vote over the seeds (A=-1, B=+1, C=0; unreadable = C), accuracy on all items",
    "acc_without_tie": f"{SOURCE}: per-item sign vote over the seeds, accuracy without true ties (a predicted C is wrong)",
    "pearson": f"{SOURCE}: first <answer>N</answer> as is (none: -1); per seed k, Pearson r over the items of seeds "
    "0..k together (nan -> 0); median over k",
    "levenshtein_norm": f"{SOURCE}: all <answer>N</answer> ranked; per seed k, mean Levenshtein/max(len) over the items of "
    "seeds 0..k together; maximum over k",
    DATASET_MEAN: f"{SOURCE}: the printed 'Ave', mean over datasets (pair: of the values rounded to 3 decimals)",
}
