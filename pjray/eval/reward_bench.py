"""Pairwise preference benchmarks of multimodal judges: VL-RewardBench and Multimodal RewardBench.

Both give an image, a query and two responses, one of them preferred by people; a judge is right
when it prefers that one. What the two share lives here: the row (`PreferenceRow`), judging every
row under each `eval.seeds` sample (the judge's outputs, one `Sample` a line), the outputs file
(`read_outputs`: outputs produced elsewhere, scored without generation), pjray's strict scoring,
the per-item verdicts the paired tests use (`item_verdicts`), and the evaluation entry points
(`pjray eval` and the trainer's validation). What differs, each benchmark's reader, prompt,
verdict reading and official scoring, is a `PreferenceBench` in `pjray.eval.vl_rewardbench` and
`pjray.eval.mm_rewardbench`.

Verdicts are read two ways, each labelled in the report:
- `official`: the benchmark's own script (its reading, its vote, its denominators: see the
  benchmark's module);
- `strict` (pjray): a verdict names response 1 or 2 unambiguously or it is wrong; accuracy over
  every row, per sample, then averaged over the samples (`eval.seed_agg`).
With the paper prompt (`eval.prompt_format=paper`: the Perception-Judge pair prompt, two scores),
both conventions read the two scores (`choice`, `pjray.eval.preference.paper_choice`) and the
official one applies the benchmark's vote and denominators to those choices.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pjray.data.hf import OpenDataset, eval_source, scan_source
from pjray.data.prompts import render_pair
from pjray.data.sources import Rows, file_rows
from pjray.eval import mm_rewardbench, vl_rewardbench
from pjray.eval.blind import MISMATCHED, shown_images
from pjray.eval.metrics import OVERALL
from pjray.eval.preference import (
    PreferenceBench,
    PreferenceDataError,
    PreferenceRow,
    Sample,
    paper_choice,
    preferred_slot,
    sample_files,
    samples_by_index,
)
from pjray.eval.report import Cell, EvalReport, seed_cells
from pjray.types import JudgePrompt

# generate(prompts, seed) -> one response text per prompt, in order.
Generate = Callable[[list[JudgePrompt], int], list[str]]

PROMPT_FORMATS = ("original", "paper")  # the benchmark's official prompt | the Perception-Judge pair prompt
MISMATCH_SEED = 0  # the derangement of eval.blind=mismatched (the same in every run)


# --------------------------------------------------------------------------- rows and prompts


def scan_rows(
    bench: PreferenceBench, source: str | Path | OpenDataset, image_dir: str | Path | None = None, limit: int = 0
) -> Rows[PreferenceRow]:
    """The benchmark's rows from a file (parquet, JSON list, JSONL) or a dataset, each with its
    0-based position among the rows read; a bad row is a reject naming it."""
    position = itertools.count()
    return scan_source(
        source,
        lambda raw, root, where: bench.parse_row(raw, root, where, next(position)),
        image_dir,
        limit,
        PreferenceDataError,
    )


def judge_prompt(bench: PreferenceBench, row: PreferenceRow, swapped: bool, prompt_format: str) -> JudgePrompt:
    """The prompt of one sample: the benchmark's official prompt (one user turn, its image, no
    system prompt) or pjray's paper pair prompt, responses in the order `swapped` says."""
    if prompt_format == "paper":
        return render_pair(
            row.query,
            row.image,
            *row.responses,
            item_id=f"{bench.NAME}-{row.index}",
            truth="AB"[row.better],
            swap=swapped,
        )
    if prompt_format != "original":
        raise ValueError(f"unknown prompt format {prompt_format!r}; expected one of {PROMPT_FORMATS}")
    return JudgePrompt(
        item_id=f"{bench.NAME}-{row.index}",
        system="",
        user=bench.official_prompt(row, swapped),
        image=row.image,
        protocol="pair",
        style="original",
        num_candidates=2,
        shown=(1, 0) if swapped else (0, 1),
        target="AB"[preferred_slot(row, swapped) - 1],
    )


def choice(bench: PreferenceBench, text: str, prompt_format: str) -> int | None:
    """pjray's strict choice: 1 or 2, None when the verdict does not name one. With the paper
    prompt, the higher of the two scores; equal scores choose nothing."""
    return paper_choice(text) if prompt_format == "paper" else bench.strict_choice(text)


# --------------------------------------------------------------------------- samples


def judge_rows(
    bench: PreferenceBench,
    rows: Sequence[PreferenceRow],
    images: Sequence[bytes | None],
    prompt_format: str,
    seeds: Sequence[int],
    generate: Generate,
    orders: Callable[[PreferenceRow, int], list[bool]] | None = None,
) -> list[Sample]:
    """Every row judged once per seed (one sample per seed, each with its own response order:
    `orders(row, seed)`, by default the benchmark's one order), row by row in the result."""
    orders = orders or (lambda row, seed: [bench.swapped(row, seed)])
    per_row: dict[int, list[Sample]] = defaultdict(list)
    for seed in seeds:
        plan = [(row, image, s) for row, image in zip(rows, images) for s in orders(row, seed)]
        prompts = [judge_prompt(bench, replace(row, image=image), s, prompt_format) for row, image, s in plan]
        for (row, _, s), text in zip(plan, generate(prompts, seed)):
            per_row[row.index].append(Sample(row.index, text, s, seed))
    return [s for row in rows for s in per_row[row.index]]


def read_outputs(
    bench: PreferenceBench, path: str | Path, rows: Sequence[PreferenceRow]
) -> tuple[list[Sample], list[str]]:
    """The samples of an outputs file (`eval.outputs`) for `rows`, in file order, and notes on
    what the file leaves out. A line naming no row of the benchmark, or without its output
    (or, where the order varies per sample, its `swapped`), is an error naming the line.

    The layout (`outputs.jsonl`, written by every run): one JSON object a line, `{"row": <0-based
    row index>, "output": "<raw text>", "swapped": <true when response 2 / Output2 was shown
    first>}`; a run also writes the sample's `seed`. The lines of a row, in file order, are its
    samples; the official scripts' line order is row by row, and VL-RewardBench's official vote
    depends on it (its seeded shuffle runs over the lines as they stand)."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceDataError(f"eval.outputs: {path}: no such file")
    indices = {r.index for r in rows}
    samples = []
    bad = Rows[Any](str(path))
    for where, raw in file_rows(path, bad):
        if bad.rejects:  # a line that is not JSON, before this one
            break
        if not isinstance(raw, dict) or not isinstance(raw.get("row"), int) or isinstance(raw.get("row"), bool):
            raise PreferenceDataError(f'{where}: expected {{"row": <int>, "output": <str>, ...}}')
        if raw["row"] not in indices:
            raise PreferenceDataError(
                f"{where}: row {raw['row']} is not a row of the benchmark as read "
                f"({len(rows)} rows; eval.limit and rejected rows leave rows out)"
            )
        if not isinstance(raw.get("output"), str):
            raise PreferenceDataError(f"{where}: 'output' must be the judge's raw text (a string)")
        swapped = raw.get("swapped", None)
        if swapped is None and not bench.FIXED_ORDER:
            raise PreferenceDataError(
                f"{where}: 'swapped' is required ({bench.NAME} shows the responses in an order "
                "chosen per sample; true when response[1] was Answer 1)"
            )
        if swapped is not None and not isinstance(swapped, bool):
            raise PreferenceDataError(f"{where}: 'swapped' must be true or false")
        samples.append(Sample(raw["row"], raw["output"], bool(swapped)))
    if bad.rejects:
        raise PreferenceDataError(f"{bad.rejects[0].where}: {bad.rejects[0].reason}")
    if not samples:
        raise PreferenceDataError(f"eval.outputs: {path}: no outputs")
    judged = {s.row for s in samples}
    notes = []
    if len(judged) < len(rows):
        notes.append(
            f"eval.outputs: {len(rows) - len(judged)} of {len(rows)} rows have no output in {path}: "
            "left out of every number"
        )
    return samples, notes


# --------------------------------------------------------------------------- strict scoring


def _groups_in_order(bench: PreferenceBench, rows: Sequence[PreferenceRow]) -> list[str]:
    seen = list(dict.fromkeys(r.group for r in rows))
    return [g for g in bench.GROUPS if g in seen] + [g for g in seen if g not in bench.GROUPS]


@dataclass(frozen=True)
class _Rate:
    value: float | None
    n: int
    unparsed: int = 0


def strict_table(
    bench: PreferenceBench,
    rows: Sequence[PreferenceRow],
    samples: Sequence[Sample],
    prompt_format: str,
    seed_agg: str = "mean",
    macro: str | None = None,
) -> dict[str, Cell]:
    """pjray's strict accuracy: sample i of every row judged (an unreadable verdict is wrong),
    per group and pooled (`overall`), then aggregated over the samples; `macro` names a row
    holding the mean of the per-group values (VL-RewardBench's macro average)."""
    by_row = {r.index: r for r in rows}
    groups = _groups_in_order(bench, [by_row[i] for i in samples_by_index(samples)])
    per_sample = []
    for file in sample_files(samples):
        right: dict[str, list[bool]] = defaultdict(list)
        unparsed: dict[str, int] = defaultdict(int)
        for s in file:
            row = by_row[s.row]
            c = choice(bench, s.output, prompt_format)
            right[row.group].append(c == preferred_slot(row, s.swapped))
            unparsed[row.group] += c is None
        table = {g: _Rate(_mean(right[g]), len(right[g]), unparsed[g]) for g in groups if right[g]}
        pooled = [x for g in groups for x in right[g]]
        table[OVERALL] = _Rate(_mean(pooled), len(pooled), sum(unparsed.values()))
        if macro:
            values = [table[g].value for g in bench.GROUPS if g in table]
            table[macro] = _Rate(statistics.fmean(values) if len(values) == len(bench.GROUPS) else None, len(pooled))
        per_sample.append(table)
    return seed_cells(per_sample, seed_agg)


def _mean(values: Sequence[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def item_verdicts(
    bench: PreferenceBench, rows: Sequence[PreferenceRow], samples: Sequence[Sample], prompt_format: str
) -> dict[int, bool]:
    """Row index -> right (pjray's strict reading, more than half of its samples right): the
    per-item verdicts of the blind twin's and the judge-vs-judge paired tests."""
    by_row = {r.index: r for r in rows}
    out = {}
    for index, got in samples_by_index(samples).items():
        row = by_row[index]
        right = sum(choice(bench, s.output, prompt_format) == preferred_slot(row, s.swapped) for s in got)
        out[index] = right > len(got) / 2
    return out


# --------------------------------------------------------------------------- evaluation


# Each benchmark's module is its PreferenceBench.
BENCHES: dict[str, PreferenceBench] = {m.NAME: m for m in (vl_rewardbench, mm_rewardbench)}  # type: ignore[misc]


def bench_of(name: str) -> PreferenceBench:
    if name not in BENCHES:
        raise ValueError(f"unknown preference benchmark {name!r}; expected one of {', '.join(BENCHES)}")
    return BENCHES[name]


def prompt_format_of(e: Any) -> str:
    """eval.prompt_format for these benchmarks: `auto` is the benchmark's official prompt."""
    return "original" if e.prompt_format == "auto" else e.prompt_format


def load_rows(cfg: Any) -> Rows[PreferenceRow]:
    e = cfg.eval
    scanned = scan_rows(bench_of(e.bench), eval_source(e), e.image_dir or None, e.limit)
    scanned.check(cfg.data.max_reject_fraction, PreferenceDataError)
    return scanned


def evaluate_preference(cfg: Any, generate: Generate | None) -> EvalReport:
    """The report of VL-RewardBench or Multimodal RewardBench (`eval.bench`): every row judged
    under each eval.seeds sample with the images `eval.image` (or a blind mode) shows, or the
    outputs of `eval.outputs` scored without a judge; official and strict tables, the samples
    (`report.samples`) and the per-item verdicts (`report.items`)."""
    e = cfg.eval
    bench = bench_of(e.bench)
    fmt = prompt_format_of(e)
    scanned = load_rows(cfg)
    rows = scanned.rows
    notes = [
        f"prompt format: {fmt}"
        + (" (the benchmark's official prompt)" if fmt == "original" else " (pjray's paper pair prompt: two scores)")
    ]
    if e.outputs:
        samples, more = read_outputs(bench, e.outputs, rows)
        notes += more
        notes.append(f"outputs read from {e.outputs} (eval.outputs), not generated")
    else:
        assert generate is not None
        images = shown_images([r.image for r in rows], e.image, MISMATCH_SEED)
        samples = judge_rows(bench, rows, images, fmt, e.seeds, generate, _orders(bench, e))
    tables, sources, more = bench.official_tables(rows, samples, fmt)
    notes += more
    tables.update(_strict_tables(bench, rows, samples, fmt, e))
    sources.update({name: text for name, text in _STRICT_SOURCES.items() if name in tables})
    unreadable = [s.output for s in samples if _official_unreadable(bench, s.output, fmt)]
    items = item_verdicts(bench, rows, samples, fmt)
    return EvalReport(
        bench=e.bench,
        judge=e.judge or e.outputs,
        data=e.data,
        seeds=list(e.seeds),
        tables=tables,
        outputs=len(samples),
        unparsed=len(unreadable),
        unparsed_examples=[t[:200].replace("\n", " ") for t in unreadable[:5]],
        notes=notes,
        convention=f"official: {bench.SOURCE}; strict: pjray's reading beside it",
        sources=sources,
        rejects=scanned.rejects,
        samples=[s.line() for s in samples],
        items={r.index: {"group": r.group, "right": items[r.index]} for r in rows if r.index in items},
    )


def _orders(bench: PreferenceBench, e: Any) -> Callable[[PreferenceRow, int], list[bool]]:
    if e.both_orders:
        return lambda row, seed: [False, True]
    return lambda row, seed: [bench.swapped(row, seed)]


def _official_unreadable(bench: PreferenceBench, text: str, fmt: str) -> bool:
    return (paper_choice(text) if fmt == "paper" else bench.official_choice(text)) is None


_STRICT_SOURCES = {
    "strict": "pjray: a verdict naming response 1 or 2 (else wrong), accuracy over every row per sample, "
    "averaged over the samples (eval.seed_agg)",
    "strict_swapped_order": "pjray: as strict, the samples judged with Output2 shown as A (eval.both_orders)",
}


def _strict_tables(bench: PreferenceBench, rows, samples, fmt: str, e: Any) -> dict[str, dict[str, Cell]]:
    straight = [s for s in samples if not s.swapped] if bench.FIXED_ORDER else samples
    out = {"strict": strict_table(bench, rows, straight, fmt, e.seed_agg, bench.MACRO)}
    if bench.FIXED_ORDER and any(s.swapped for s in samples):
        out["strict_swapped_order"] = strict_table(bench, rows, [s for s in samples if s.swapped], fmt, e.seed_agg)
    return out


# --------------------------------------------------------------------------- training-time validation


class TrainingValidation:
    """`eval.train_bench=vl_rewardbench|mm_rewardbench` for the trainer: `eval.train_num_items`
    rows of `eval.data` (drawn with `eval.train_seed`, the same every time) judged by the
    trainer's rollout workers every `eval.every_steps` steps, one sample per row at the rollout's
    sampling settings, the benchmark's own response order. Logged: `eval/<bench>/accuracy`
    (pjray's strict reading, pooled) and per group, the unreadable fraction, and with
    `eval.blind=[mismatched]` the accuracy with mismatched images and `eval/<bench>/gap`
    (real minus mismatched): the metric `trainer.keep_best` can keep the best checkpoint by."""

    def __init__(self, cfg: Any):
        e = cfg.eval
        self.bench = bench_of(e.train_bench)
        rows = load_rows(replace(cfg, eval=replace(e, bench=e.train_bench, limit=0))).rows
        if len(rows) > e.train_num_items:
            rows = sorted(random.Random(e.train_seed).sample(rows, e.train_num_items), key=lambda r: r.index)
        self.rows = rows
        self.fmt = prompt_format_of(e)
        self.mismatched = MISMATCHED in e.blind
        self.seed = e.train_seed

    def __call__(self, cfg: Any, generate: Generate, step: int) -> dict[str, float]:
        prefix = f"eval/{self.bench.NAME}/"
        seed = self.seed * 1_000_003 + step
        out: dict[str, float] = {}
        passes = {"": [r.image for r in self.rows]}
        if self.mismatched:
            passes["_mismatched"] = shown_images(passes[""], MISMATCHED, MISMATCH_SEED)
        for suffix, images in passes.items():
            samples = judge_rows(self.bench, self.rows, images, self.fmt, [seed], generate)
            table = strict_table(self.bench, self.rows, samples, self.fmt, macro=self.bench.MACRO)
            for row, cell in table.items():
                if cell.value is not None:
                    out[prefix + ("accuracy" if row == OVERALL else row) + suffix] = cell.value
            out[prefix + "unparsed" + suffix] = table[OVERALL].unparsed / max(1, table[OVERALL].n)
        if self.mismatched:
            out[prefix + "gap"] = out[prefix + "accuracy"] - out[prefix + "accuracy_mismatched"]
        return out
