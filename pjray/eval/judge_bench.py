"""MLLM-as-a-Judge (Chen et al., ICML 2024): loaders, judge prompts and reading the verdicts.

The published `score`, `pair` and `batch` JSONL files (repo Dongping-Chen/MLLM-Judge, HF copies
`shuaishuaicdp/MLLM-Judge`, `ONE-Lab/MLLM-as-a-Judge`) come in two field-name variants; both are
read, the variant detected per row (`scan_rows`), and a row with neither spelling fails with the
file, line and the keys it has. Images are read from `image_dir` (the JSONL's folder if empty).
The same rows may come from a dataset (`eval.data` a hub id or a folder, `pjray.data.hf`), where
an image may also be an `Image` feature or bytes.

Two prompt formats (`eval.prompt_format`, `build_prompt`): `paper` (the default, `auto`), the
Perception-Judge release's think/answer prompts (`pjray.data.prompts`), whose 1-10 scores the
score protocol maps onto the benchmark's 1-5 (`eval.score_mapping`: ceil(v/2), as the release's
evaluation does); and `original`, the benchmark's own layout (`original_prompt_text`). Verdicts
are read from the answer blocks whatever the think layout (a judgment, not a reward), so whether
the prompt opened `<think>` does not change any number here.

Whose evaluation turns the judge's texts into the numbers (`eval.convention`, `evaluate_bench`):
- `strict` (default): pjray's reading (`read_score` / `read_pair` / `read_batch`) and the
  official notebook's metrics (`pjray.eval.metrics`), with the eval.* options on top.
- `perception_judge`: the Perception-Judge release's notebook end to end, its reading, metrics
  and seed averaging (`pjray.eval.perception_judge`). Paper prompt only.
- `flex_judge`: Flex-Judge's `test/evaluate.py` end to end (`pjray.eval.flex_judge`).
  Paper prompt only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pjray.data.hf import OpenDataset, eval_source, scan_source
from pjray.data.prompts import LETTERS, order_from_ranking, render_batch, render_pair, render_score
from pjray.data.sources import DataError, Rows, image_bytes
from pjray.eval.blind import shown_images
from pjray.eval.metrics import BatchRecord, PairRecord, ScoreRecord, map_score
from pjray.reward.parse import parse_judgment, parse_pair, parse_score, ranking_from_scores
from pjray.types import JudgeItem, JudgePrompt

if TYPE_CHECKING:
    from pjray.eval.report import EvalReport

PROTOCOLS = ("score", "pair", "batch")
PROMPT_FORMATS = ("paper", "original")
CONVENTIONS = ("strict", "perception_judge", "flex_judge")  # eval.convention


class BenchDataError(DataError):
    """A bad benchmark row: the message names the file, line and key."""

    what = "bad data"


@dataclass(frozen=True)
class BenchRow:
    """One MLLM-as-a-Judge row, protocol-independent.

    score: one answer, truth = the human 1-5 score as a string. pair: two answers, truth "A",
    "B" or "C" (tie). batch: K answers, truth = letters best -> worst ("CDAB").
    """

    protocol: str
    id: str
    dataset: str
    instruction: str
    image: bytes | None
    answers: tuple[str, ...]
    truth: str


# --------------------------------------------------------------------------- loading

_TRUTH_KEYS = {"score": ("human", "human_score"), "pair": ("human_answer", "human"), "batch": ("human_answer", "human")}


def _first(row: dict, keys: tuple[str, ...], where: str, required: bool = True):
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    if required:
        raise BenchDataError(f"{where}: none of the keys {list(keys)} (row has {sorted(row)})")
    return None


def _answer_text(value, where: str) -> str:
    if isinstance(value, dict):
        if "answer" not in value:
            raise BenchDataError(f"{where}: answer object without an 'answer' key (has {sorted(value)})")
        return str(value["answer"])
    if isinstance(value, str):
        return value
    raise BenchDataError(f"{where}: answer is {type(value).__name__}, expected a string or {{name, answer}}")


def _pair_truth(value, where: str) -> str:
    s = str(value).strip().upper().strip("[]")
    s = {"TIE": "C"}.get(s, s)
    if s not in ("A", "B", "C"):
        raise BenchDataError(f"{where}: pair truth {value!r} is not A, B or C (tie)")
    return s


def _batch_truth(value, k: int, where: str) -> str:
    s = "".join(value) if isinstance(value, list) else str(value)
    s = "".join(c for c in s.upper() if c.isalpha())
    if sorted(s) != list(LETTERS[:k]):
        raise BenchDataError(f"{where}: batch truth {value!r} is not a ranking of the {k} answers {LETTERS[:k]}")
    return s


def _score_truth(value, where: str) -> str:
    try:
        return str(int(float(str(value).strip())))  # "4", 4 and 4.0 all occur
    except ValueError:
        raise BenchDataError(f"{where}: score truth {value!r} is not a number") from None


def scan_rows(
    source: str | Path | OpenDataset, protocol: str, image_dir: str | Path | None = None, limit: int = 0
) -> Rows[BenchRow]:
    """The rows of `protocol` (score | pair | batch) from a published MLLM-as-a-Judge JSONL file or
    a dataset (`pjray.data.hf.open_dataset`), up to `limit` good ones (0: all); a line that is not
    JSON or lacks a key or its image is a reject naming the file (or dataset) and line, not an error.

    The two field-name variants, detected per row:

        truth:   score `human` | `human_score`;  pair / batch `human_answer` | `human`
        image:   `image_path` | `image`;        dataset: `original_dataset` | `dataset`
        answers: pair `answer1`/`answer2` as {name, answer} or plain strings;
                 batch `answers` as a list of {name, answer} or plain strings
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    return scan_source(
        source, lambda raw, root, where: _row(raw, protocol, root, where), image_dir, limit, BenchDataError
    )


def read_rows(path: str | Path, protocol: str, image_dir: str | Path | None = None, limit: int = 0) -> list[BenchRow]:
    """`scan_rows`, with any bad line an error naming it."""
    rows = scan_rows(path, protocol, image_dir, limit)
    rows.check(0.0, BenchDataError)
    return rows.rows


def _row(raw: dict, protocol: str, root: Path, where: str) -> BenchRow:
    instruction = str(_first(raw, ("instruction", "question"), where))
    dataset = str(_first(raw, ("original_dataset", "dataset"), where))
    image = image_bytes(_first(raw, ("image_path", "image"), where, required=False), root, where)
    truth_raw = _first(raw, _TRUTH_KEYS[protocol], where)
    if protocol == "score":
        answers = (_answer_text(_first(raw, ("answer",), where), where),)
        truth = _score_truth(truth_raw, where)
        row_id = str(raw.get("score_id", raw.get("id", "")))
    elif protocol == "pair":
        answers = (
            _answer_text(_first(raw, ("answer1",), where), where),
            _answer_text(_first(raw, ("answer2",), where), where),
        )
        truth = _pair_truth(truth_raw, where)
        row_id = str(raw.get("pair_id", raw.get("id", "")))
    else:
        listed = _first(raw, ("answers",), where)
        if not isinstance(listed, list) or len(listed) < 2:
            raise BenchDataError(f"{where}: 'answers' must be a list of at least 2 answers")
        answers = tuple(_answer_text(a, where) for a in listed)
        truth = _batch_truth(truth_raw, len(answers), where)
        row_id = str(raw.get("id", ""))
    return BenchRow(protocol, f"{protocol}-{row_id}" if row_id else where, dataset, instruction, image, answers, truth)


# --------------------------------------------------------------------------- prompts

_ORIGINAL_START = (
    "Please serve as an unbiased judge in assessing the quality of the responses from AI "
    "assistants regarding the user's instruction and a figure."
)
_ORIGINAL_SETTING = (
    "You will be presented with a figure, a user instruction and the answer(s) of AI "
    "assistant(s). Read the instruction and the figure carefully, then evaluate the answer(s)."
)
_ORIGINAL_TASK = {
    "score": (
        "Rate the answer on a scale of 1 to 5 for relevance, accuracy, helpfulness and "
        'consistency with the figure, and give your final judgement as "[[N]]" with N from 1 to 5.'
    ),
    "pair": (
        'Compare the two answers and decide which one is better. Output "[[A]]" if Assistant A '
        'is better, "[[B]]" if Assistant B is better, and "[[C]]" for a tie.'
    ),
    "batch": (
        "Rank all the answers from best to worst and give the ranking as the letters in order, "
        'for example "[[A]], [[B]], [[C]], [[D]]".'
    ),
}
_ORIGINAL_NOTICE = (
    "Avoid any position or length bias. Output your evaluation as a JSON object with the keys "
    "'Analysis' and 'Judgement'."
)


def _original_blocks(instruction: str, answers: tuple[str, ...]) -> str:
    blocks = [f"[The Start of User Instruction]\n{instruction}\n[The End of User Instruction]"]
    if len(answers) == 1:
        blocks.append(f"[The Start of Assistant\u2019s Answer]\n{answers[0]}\n[The End of Assistant\u2019s Answer]")
    else:
        for i, a in enumerate(answers):
            name = f"Assistant {LETTERS[i]}\u2019s Answer"  # the benchmark's curly apostrophe
            blocks.append(f"[The Start of {name}]\n{a}\n[The End of {name}]")
    return "\n".join(blocks)


def original_prompt_text(row: BenchRow) -> str:
    """The benchmark's prompt layout: start, Evaluation Steps, Evaluation Method, Notice, the
    input blocks; verdicts `[[N]]`, `[[A]]`/`[[B]]`/`[[C]]`, `[[A]], [[B]], ...`. The section
    texts are written after `scripts/prompt.py`'s "No COT" setting but are not its verbatim
    strings; the verdict format and the block markers are."""
    return (
        _ORIGINAL_START
        + "\nEvaluation Steps:\n"
        + _ORIGINAL_SETTING
        + "\nEvaluation Method:\n"
        + _ORIGINAL_TASK[row.protocol]
        + "\nNotice:\n"
        + _ORIGINAL_NOTICE
        + "\nHere is the input:\n"
        + _original_blocks(row.instruction, row.answers)
    )


def build_prompt(row: BenchRow, prompt_format: str = "paper", batch_style: str = "scores") -> JudgePrompt:
    """The judge prompt of one row. Answers keep the benchmark's letters (no shuffle): the
    human truth is given in those letters. `batch_style` (paper format): `scores` (the release's
    one score per answer) or `ranking` (one letter ranking)."""
    if prompt_format == "original":
        return JudgePrompt(
            item_id=row.id,
            system="",
            user=original_prompt_text(row),
            image=row.image,
            protocol=row.protocol,
            style="original",
            num_candidates=len(row.answers),
            shown=tuple(range(len(row.answers))),
            target=row.truth,
        )
    if prompt_format != "paper":
        raise ValueError(f"unknown prompt format {prompt_format!r}; expected one of {PROMPT_FORMATS}")
    if row.protocol == "score":
        return render_score(row.instruction, row.image, row.answers[0], item_id=row.id, truth=row.truth)
    if row.protocol == "pair":
        return render_pair(row.instruction, row.image, *row.answers, item_id=row.id, truth=row.truth)
    item = JudgeItem(
        id=row.id,
        image=row.image or b"",
        question=row.instruction,
        candidates=row.answers,
        order=order_from_ranking(row.truth),
        source=row.dataset,
    )
    prompt = render_batch(item, random.Random(0), style=batch_style, shuffle=False)
    if row.image is None:  # render_batch always carries the item's image
        prompt = replace(prompt, image=None)
    return prompt


# --------------------------------------------------------------------------- reading verdicts

_BRACKET_RE = re.compile(r"\[\[\s*([A-Za-z0-9.]+)\s*\]\]")


def _original_verdicts(text: str) -> list[str]:
    """The `[[X]]` tokens of the last 'Judgement' value if there is one, else of the whole text."""
    tail = text[text.rfind("Judgement") :] if "Judgement" in text else text
    return _BRACKET_RE.findall(tail)


def read_score(text: str, prompt_format: str, mapping: str) -> float | None:
    """The judge's score on the benchmark's 1-5 scale, or None when unreadable.

    paper: the integer in the last <answer> block (1-10), mapped with `mapping`. A badly
    formatted response still counts when its score can be read (it is a judgment, not a
    reward); a score outside 1-10 is unreadable. original: the last `[[N]]`, N in 1-5.
    """
    if prompt_format == "original":
        for token in reversed(_original_verdicts(text)):
            try:
                v = float(token)
            except ValueError:
                continue
            return v if 1 <= v <= 5 else None
        return None
    judgment = parse_score(text)
    if not judgment.scores or not 1 <= judgment.scores[0] <= 10:
        return None
    return map_score(judgment.scores[0], mapping)


def read_pair(text: str, prompt_format: str) -> str | None:
    """ "A", "B", "C" (tie) or None. paper: two scores (equal = tie); original: the last [[X]]."""
    if prompt_format == "original":
        for token in reversed(_original_verdicts(text)):
            if token.upper() in ("A", "B", "C"):
                return token.upper()
        return None
    return parse_pair(text).ranking


def read_batch(text: str, k: int, prompt_format: str, style: str = "scores") -> str | None:
    """The predicted ranking string best -> worst, or None.

    paper/scores: K integer answer blocks ranked by score; tied scores are still ranked (the
    later letter first on ties, as the downstream evaluations do). paper/ranking: the letters.
    original: the `[[X]]` letters in order (partial rankings are kept: the distance counts them).
    """
    if prompt_format == "original":
        letters = [t.upper() for t in _original_verdicts(text) if t.upper() in LETTERS[:k]]
        seen = "".join(dict.fromkeys(letters))
        return seen or None
    j = parse_judgment(text, k, style=style)
    if j.ranking is not None:
        return j.ranking
    if j.scores is not None and len(j.scores) == k:
        return ranking_from_scores(j.scores)
    return None


def to_record(
    row: BenchRow,
    text: str,
    convention: str,
    prompt_format: str,
    score_mapping: str,
    batch_style: str = "scores",
):
    """The metric record of one judged row (ScoreRecord / PairRecord / BatchRecord) as read by
    `convention` (`eval.convention`); pred None: unreadable by that reading."""
    if convention == "strict":
        if row.protocol == "score":
            pred = read_score(text, prompt_format, score_mapping)
        elif row.protocol == "pair":
            pred = read_pair(text, prompt_format)
        else:
            pred = read_batch(text, len(row.answers), prompt_format, batch_style)
    elif convention in ("perception_judge", "flex_judge"):
        from pjray.eval import flex_judge, perception_judge

        release = perception_judge if convention == "perception_judge" else flex_judge
        if row.protocol == "score":
            pred = release.read_score(text)
        elif row.protocol == "pair":
            pred = release.read_pair(text)
        else:  # Perception-Judge cuts what it reads to the truth's length, Flex-Judge does not
            pred = (
                perception_judge.read_batch(text, len(row.truth))
                if release is perception_judge
                else flex_judge.read_batch(text)
            )
    else:
        raise ValueError(f"unknown convention {convention!r}; expected one of {CONVENTIONS}")
    if row.protocol == "score":
        return ScoreRecord(row.dataset, pred, float(row.truth))
    if row.protocol == "pair":
        return PairRecord(row.dataset, pred, row.truth)
    return BatchRecord(row.dataset, pred, row.truth)


# --------------------------------------------------------------------------- evaluation


def resolve_score_mapping(prompt_format: str, score_mapping: str) -> str:
    """`auto`: ceil_half for the paper prompt (scores 1-10), none for the original (1-5)."""
    if score_mapping != "auto":
        return score_mapping
    return "ceil_half" if prompt_format == "paper" else "none"


_NOTEBOOK = "MLLM-as-a-Judge (Dongping-Chen/MLLM-Judge scripts/calculate_metrics.ipynb)"
_ANALYSIS = "MLLM-as-a-Judge paper (scripts/Score_analysis.ipynb, scripts/pair_analysis.ipynb)"


def _strict_tables(bench: str, per_seed: list[list], e) -> tuple[dict, dict[str, str]]:
    """eval.convention=strict: the official notebook's metrics on pjray's reading, with the
    eval.* options. Returns (metric -> row -> Cell, where each table and summary row comes from)."""
    from pjray.eval.metrics import (
        DATASET_MEAN,
        OVERALL,
        PAPER_MEAN,
        batch_table,
        pair_table,
        score_table,
        vote_pairs,
        with_dataset_mean,
        with_paper_mean,
    )
    from pjray.eval.report import seed_cells

    vote = bench == "pair" and e.pair_vote == "majority"
    seeds = f"seeds aggregated by {e.seed_agg}"

    def tables(records: list) -> dict:
        if bench == "score":
            out = {"pearson": score_table(records, unparsed=e.unparsed_score)}
        elif bench == "pair":
            out = {
                "acc_with_tie": pair_table(records, with_ties=True, tie_rule=e.tie_rule),
                "acc_without_tie": pair_table(records, with_ties=False, tie_rule=e.tie_rule),
            }
        else:
            out = {
                "levenshtein_raw": batch_table(records, normalized=False),
                "levenshtein_norm": batch_table(records, normalized=True),
            }
        summary = (lambda t: with_paper_mean(with_dataset_mean(t))) if bench != "batch" else with_dataset_mean
        return {name: summary(table) for name, table in out.items()}

    by_name: dict[str, list] = {}
    for records in [vote_pairs(per_seed)] if vote else per_seed:  # voted: one table, computed once
        for name, table in tables(records).items():
            by_name.setdefault(name, []).append(table)
    if vote:
        seeds = f"verdicts voted by plurality over the {len(e.seeds)} seeds (pjray's rule; ties: the earliest seed's), accuracy computed once"
    reading = "pjray's strict reading (pjray.reward.parse)" if e.prompt_format == "paper" else "the last [[X]] verdicts"
    ties = (
        "items with a true or predicted tie skipped"
        if e.tie_rule == "official"
        else "only true ties skipped (downstream), a predicted tie is wrong"
    )
    unparsed = "left out of r" if e.unparsed_score == "drop" else "kept as -1 in r"
    sources = {
        "pearson": f"{_NOTEBOOK} pearsonr, on {reading} (scores mapped to 1-5 with "
        f"{resolve_score_mapping(e.prompt_format, e.score_mapping)}); unreadable scores {unparsed}; {seeds}",
        "acc_with_tie": f"{_NOTEBOOK} accuracy with ties, on {reading}; an unreadable verdict is wrong; {seeds}",
        "acc_without_tie": f"{_NOTEBOOK} accuracy without ties ({e.tie_rule}: {ties}), on {reading}; {seeds}",
        "levenshtein_raw": f"{_NOTEBOOK} raw Levenshtein distance, on {reading}; unreadable = empty ranking; {seeds}",
        "levenshtein_norm": f"pjray: Levenshtein / max(len) (the papers' tables), on {reading}; {seeds}",
        OVERALL: f"{_NOTEBOOK}: pooled over the items of all datasets",
        DATASET_MEAN: "pjray: mean of the defined per-dataset values",
        PAPER_MEAN: f"{_ANALYSIS}: sum of the per-dataset values / number of datasets (a dataset without items adds 0, "
        "an undefined one leaves it undefined)",
    }
    out = {name: seed_cells(tables_, e.seed_agg) for name, tables_ in by_name.items()}
    return out, sources


def evaluate_bench(cfg, generate) -> EvalReport:
    """Judge every row of `cfg.eval.data` under each seed; per-dataset tables as `eval.convention`
    makes them: `strict` (the official notebook's metrics on pjray's reading, per seed then
    aggregated by eval.seed_agg, or voted with eval.pair_vote=majority), `perception_judge` or
    `flex_judge` (the release scripts end to end, `pjray.eval.perception_judge` / `flex_judge`)."""
    from pjray.eval.report import EvalReport

    e = cfg.eval
    if e.prompt_format == "auto":  # MLLM-as-a-Judge's auto is the paper prompt
        e = replace(e, prompt_format="paper")
    mapping = resolve_score_mapping(e.prompt_format, e.score_mapping)
    scanned = scan_rows(eval_source(e), e.bench, e.image_dir or None, e.limit)
    scanned.check(cfg.data.max_reject_fraction, BenchDataError)
    shown = shown_images([r.image for r in scanned.rows], e.image)
    rows = [replace(r, image=image) for r, image in zip(scanned.rows, shown)]
    prompts = [build_prompt(r, e.prompt_format, e.batch_style) for r in rows]
    per_seed: list[list] = []
    unparsed, examples = 0, []
    for seed in e.seeds:
        texts = generate(prompts, seed)
        records = [to_record(r, t, e.convention, e.prompt_format, mapping, e.batch_style) for r, t in zip(rows, texts)]
        for rec, text in zip(records, texts):
            if rec.pred is None:
                unparsed += 1
                if len(examples) < 5:
                    examples.append(text[:200].replace("\n", " "))
        per_seed.append(records)
    notes = [f"prompt format: {e.prompt_format}"]
    if e.convention == "strict":
        tables, sources = _strict_tables(e.bench, per_seed, e)
        convention = f"strict: pjray's reading, the metrics of {_NOTEBOOK}"
    else:
        from pjray.eval import flex_judge, perception_judge

        release = perception_judge if e.convention == "perception_judge" else flex_judge
        tables = release.TABLES[e.bench](per_seed)
        sources = dict(release.SOURCES)
        convention = f"{e.convention}: {release.SOURCE}"
        notes.append(
            "unparsed counts the outputs the release's reading could not read; the release then uses its own stand-in "
            "(pair: C, score: -1, batch: an empty ranking)"
        )
        if e.convention == "perception_judge" and e.bench == "batch":
            skipped = sum(len(r.truth) < perception_judge.MIN_BATCH for r in rows)
            notes.append(f"{skipped} item(s) with <= 2 answers skipped per seed (counted as `skipped`)")
    return EvalReport(
        bench=e.bench,
        judge=e.judge,
        data=e.data,
        seeds=list(e.seeds),
        tables=tables,
        outputs=len(prompts) * len(e.seeds),
        unparsed=unparsed,
        unparsed_examples=examples,
        notes=notes,
        convention=convention,
        sources={k: v for k, v in sources.items() if k in tables or _is_row(k, tables)},
        rejects=scanned.rejects,
    )


def _is_row(name: str, tables: dict) -> bool:
    return any(name in rows for rows in tables.values())
