"""Evaluation reports: one JSON with every number, a markdown table, and matplotlib PNG plots.

A report is a set of named tables (`metric -> row -> Cell`): rows are source datasets (plus
`overall`) for MLLM-as-a-Judge, rates for the Mode a/b diagnosis, bias types and categories for
MM-JudgeBias. Each cell carries the seed-aggregated value, its std over seeds, the per-seed
values, how many items entered it, and how many judge outputs were unreadable. A report with
blind passes (`eval.blind`) carries each pass's tables beside its own (`blind`).

Every report names the convention that produced its numbers (`convention`: whose reading and
whose metric code) and, per table and per summary row, where that number is defined
(`sources`: the official file and function, or "pjray" for pjray's own rules).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pjray.data.sources import RowReject, write_rejects
from pjray.eval.metrics import BIAS_TYPES, aggregate_seeds, paired_verdicts

REJECTS_FILE = "rejects.jsonl"


@dataclass(frozen=True)
class Cell:
    value: float | None  # aggregated over seeds; None: undefined on every seed
    std: float | None = None
    per_seed: tuple[float | None, ...] = ()
    n: int = 0  # items in the metric (summed over seeds)
    unparsed: int = 0  # unreadable judge outputs (summed over seeds)
    skipped: int = 0  # items left out by the metric's rule (summed over seeds)


@dataclass(frozen=True)
class BlindPass:
    """The same evaluation judged again with eval.image=<mode> (`eval.blind`)."""

    tables: dict[str, dict[str, Cell]]  # as EvalReport.tables
    outputs: int
    unparsed: int
    unparsed_examples: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # as EvalReport.samples
    items: dict[int, dict[str, Any]] = field(default_factory=dict)  # as EvalReport.items


@dataclass
class EvalReport:
    bench: str
    judge: str
    data: str
    seeds: list[int]
    tables: dict[str, dict[str, Cell]]  # metric -> row -> cell, in display order
    outputs: int  # judge outputs read (all seeds)
    unparsed: int  # of which unreadable
    unparsed_examples: list[str] = field(default_factory=list)  # a few, truncated
    notes: list[str] = field(default_factory=list)  # skipped items, prompt format, ...
    settings: dict[str, Any] = field(default_factory=dict)
    cache_hits: int = 0
    convention: str = ""  # whose reading and metric code produced the numbers
    sources: dict[str, str] = field(default_factory=dict)  # table or summary row -> where it is defined
    # Data rows left out as unusable (within data.max_reject_fraction); also in rejects.jsonl.
    rejects: list[RowReject] = field(default_factory=list)
    blind: dict[str, BlindPass] = field(default_factory=dict)  # eval.blind mode -> its pass
    # The judge outputs, one line each, in the outputs-file layout (preference benchmarks:
    # pjray.eval.reward_bench); written to outputs.jsonl (a blind pass's: outputs.<mode>.jsonl).
    samples: list[dict[str, Any]] = field(default_factory=list)
    # Row index -> {group, right}: the per-item verdicts of the paired tests (items.jsonl).
    items: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Paired exact McNemar tests on the per-item verdicts, by name ("real vs mismatched"): one
    # row per group and pooled (pjray.eval.metrics.paired_verdicts).
    paired: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def flat_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """`eval/<table>/<row>` -> value, and `eval/blind/<mode>/<table>/<row>` for each blind
        pass, for W&B (undefined values left out)."""
        passes = {prefix: self.tables, **{f"{prefix}blind/{mode}/": p.tables for mode, p in self.blind.items()}}
        out = {
            f"{at}{table}/{row}": cell.value
            for at, tables in passes.items()
            for table, rows in tables.items()
            for row, cell in rows.items()
            if cell.value is not None
        }
        out[f"{prefix}unparsed_fraction"] = self.unparsed / self.outputs if self.outputs else 0.0
        out[f"{prefix}rejected"] = float(len(self.rejects))
        return out  # type: ignore[return-value]


def seed_cells(per_seed_rows: list[dict[str, Any]], how: str) -> dict[str, Cell]:
    """Combine one table computed per seed (row -> object with value, n[, unparsed, skipped])
    into cells aggregated over seeds. A row missing on a seed counts as undefined there."""
    names: list[str] = []
    for rows in per_seed_rows:
        names += [r for r in rows if r not in names]
    cells = {}
    for name in names:
        got = [rows.get(name) for rows in per_seed_rows]
        agg = aggregate_seeds([None if g is None else g.value for g in got], how)
        cells[name] = Cell(
            value=agg.value,
            std=agg.std,
            per_seed=agg.per_seed,
            n=sum(getattr(g, "n", 0) for g in got if g is not None),
            unparsed=sum(getattr(g, "unparsed", 0) for g in got if g is not None),
            skipped=sum(getattr(g, "skipped", 0) + getattr(g, "dropped_none", 0) for g in got if g is not None),
        )
    return cells


# --------------------------------------------------------------------------- writers


def _fmt(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def to_markdown(report: EvalReport) -> str:
    """The report as markdown: one row per dataset/bias, one column per metric table (each
    followed by its blind passes' columns); n and unparsed are the main pass's."""
    lines = [
        f"# Evaluation: {report.bench}",
        "",
        f"- judge: `{report.judge}`",
        f"- data: `{report.data or 'synthetic scenes'}`",
    ]
    lines.append(f"- seeds: {report.seeds}")
    frac = report.unparsed / report.outputs if report.outputs else 0.0
    lines.append(f"- judge outputs: {report.outputs}, unparseable: {report.unparsed} ({frac:.1%})")
    for mode, blind in report.blind.items():
        frac = blind.unparsed / blind.outputs if blind.outputs else 0.0
        lines.append(
            f"- blind pass [{mode}]: judge outputs {blind.outputs}, unparseable: {blind.unparsed} ({frac:.1%})"
        )
    if report.rejects:
        first = report.rejects[0]
        lines.append(
            f"- data rows rejected: {len(report.rejects)} (listed in {REJECTS_FILE}), e.g. `{first.where}`: {first.reason}"
        )
    if report.cache_hits:
        lines.append(f"- outputs taken from the cache: {report.cache_hits}")
    if report.convention:
        lines.append(f"- convention: {report.convention}")
    lines += [f"- {note}" for note in report.notes]
    lines.append("")
    # Each blind pass's value sits beside the main one: a `<table> [<mode>]` column after `<table>`.
    passes = {"": report.tables, **{f" [{mode}]": blind.tables for mode, blind in report.blind.items()}}
    columns = [(t, suffix) for t in report.tables for suffix in passes]
    rows: list[str] = []
    for t, suffix in columns:
        rows += [r for r in passes[suffix].get(t, {}) if r not in rows]
    std_shown = len(report.seeds) > 1
    header = "| | " + " | ".join(t + suffix for t, suffix in columns) + " | n | unparsed |"
    lines += [header, "|" + "---|" * (len(columns) + 3)]
    for r in rows:
        cells = [passes[suffix].get(t, {}).get(r) for t, suffix in columns]
        shown = []
        for c in cells:
            if c is None:
                shown.append("")
            else:
                shown.append(_fmt(c.value) + (f" ± {_fmt(c.std)}" if std_shown and c.std is not None else ""))
        first = next(c for c in cells if c is not None)
        lines.append(f"| {r} | " + " | ".join(shown) + f" | {first.n} | {first.unparsed} |")
    for name, tests in report.paired.items():
        lines += [
            "",
            f"Paired test, {name} (exact McNemar on the per-item verdicts; b: right only with the first, "
            "c: right only with the second):",
            "",
            "| group | n | first | second | b | c | p |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {t['group']} | {t['n']} | {_fmt(t['accuracy_first'])} | {_fmt(t['accuracy_second'])} | {t['b']} | "
            f"{t['c']} | {t['p_value']:.3g} |"
            for t in tests
        ]
    if report.sources:
        lines += ["", "Where each number comes from:", ""]
        lines += [f"- `{name}`: {source}" for name, source in report.sources.items()]
    if report.unparsed_examples:
        lines += ["", "Unparseable outputs (first few):", ""]
        lines += [f"- `{ex}`" for ex in report.unparsed_examples]
    return "\n".join(lines) + "\n"


def _plot(report: EvalReport, out_dir: Path) -> list[Path]:
    """Per-table bar charts (per dataset / rate / bias type), plus a bias radar for MM-JudgeBias."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; set before pyplot is imported
    import matplotlib.pyplot as plt

    paths = []
    tables = list(report.tables.items())
    fig, axes = plt.subplots(
        len(tables), 1, figsize=(max(6.0, 0.6 * max(len(r) for _, r in tables) + 2), 3.2 * len(tables)), squeeze=False
    )
    for ax, (name, rows) in zip(axes[:, 0], tables):
        labels = list(rows)
        values = [rows[r].value if rows[r].value is not None else 0.0 for r in labels]
        errs = [rows[r].std or 0.0 for r in labels]
        colours = ["#555555" if r == "overall" else "#3b75af" for r in labels]
        ax.bar(range(len(labels)), values, yerr=errs, color=colours, capsize=3)
        for i, r in enumerate(labels):
            if rows[r].value is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
    fig.suptitle(f"{report.bench}: {Path(report.judge).name or report.judge}", fontsize=11)
    fig.tight_layout()
    path = out_dir / "bars.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)

    per_bias = report.tables.get("bias")
    if per_bias and all(t in per_bias for t in BIAS_TYPES):
        angles = [2 * math.pi * i / len(BIAS_TYPES) for i in range(len(BIAS_TYPES))]
        values = [per_bias[t].value or 0.0 for t in BIAS_TYPES]
        fig = plt.figure(figsize=(6, 6))
        ax = fig.add_subplot(projection="polar")
        ax.plot(angles + angles[:1], values + values[:1], color="#3b75af")
        ax.fill(angles + angles[:1], values + values[:1], color="#3b75af", alpha=0.25)
        ax.set_xticks(angles, [t.replace("_", "\n") for t in BIAS_TYPES], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title("MM-JudgeBias (BD / BC, higher is better)", fontsize=10)
        path = out_dir / "bias_radar.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(report: EvalReport, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write report.json, report.md and (optionally) PNG plots; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    body = asdict(report)
    for part in [body, *body["blind"].values()]:  # one line a sample or item, in files of their own
        del part["samples"], part["items"]
    paths["json"].write_text(json.dumps(body, indent=2, default=str))
    for mode, samples, items in [
        ("", report.samples, report.items),
        *((f".{m}", b.samples, b.items) for m, b in report.blind.items()),
    ]:
        if samples:
            paths[f"outputs{mode}"] = out / f"outputs{mode}.jsonl"
            paths[f"outputs{mode}"].write_text("".join(json.dumps(line) + "\n" for line in samples))
        if items:
            paths[f"items{mode}"] = out / f"items{mode}.jsonl"
            paths[f"items{mode}"].write_text("".join(json.dumps({"row": i, **v}) + "\n" for i, v in items.items()))
    if report.rejects:
        paths["rejects"] = out / REJECTS_FILE
        write_rejects(report.rejects, paths["rejects"])
    paths["markdown"].write_text(to_markdown(report))
    if plots:
        for p in _plot(report, out):
            paths[p.stem] = p
    return paths


def write_comparison(names: list[str], reports: list[EvalReport], out_dir: Path) -> dict[str, Path]:
    """Judge vs judge on one benchmark: compare.json / compare.md with each judge's pooled value
    of every table (and its macro row where there is one), and for every pair of judges the
    paired exact McNemar test on their per-item verdicts over the rows both judged."""
    summary_rows = ("overall", "macro")
    columns = [(t, r) for t in reports[0].tables for r in summary_rows if r in reports[0].tables[t]]
    table = [
        {f"{t}/{r}": (cell.value if (cell := rep.tables.get(t, {}).get(r)) else None) for t, r in columns}
        for rep in reports
    ]
    pairs = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            tests = paired_verdicts(reports[i].items, reports[j].items)
            pairs.append({"first": names[i], "second": names[j], "tests": tests})
    body = {"bench": reports[0].bench, "judges": names, "values": table, "paired": pairs}
    paths = {"json": out_dir / "compare.json", "markdown": out_dir / "compare.md"}
    paths["json"].write_text(json.dumps(body, indent=2))
    lines = [
        f"# Judge vs judge: {body['bench']}",
        "",
        "| judge | " + " | ".join(f"{t} {r}" for t, r in columns) + " |",
        "|" + "---|" * (len(columns) + 1),
    ]
    lines += [f"| `{n}` | " + " | ".join(_fmt(v) for v in row.values()) + " |" for n, row in zip(names, table)]
    lines += [
        "",
        "Paired exact McNemar tests on the same items (pjray's strict per-item verdicts; b: right only "
        "with the first judge, c: right only with the second). A gap whose p is large may be noise.",
        "",
    ]
    lines += [
        "| first | second | group | n | first acc | second acc | b | c | p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in pairs:
        lines += [
            f"| `{pair['first']}` | `{pair['second']}` | {t['group']} | {t['n']} | {_fmt(t['accuracy_first'])} | "
            f"{_fmt(t['accuracy_second'])} | {t['b']} | {t['c']} | {t['p_value']:.3g} |"
            for t in pair["tests"]
        ]
    paths["markdown"].write_text("\n".join(lines) + "\n")
    return paths


def log_wandb(report: EvalReport, tracking_cfg: Any, out_dir: Path, config: dict[str, Any]) -> None:
    """Log the report's numbers (and plots) to W&B through `pjray.tracking.Tracker`."""
    from pjray.tracking import Tracker

    tracker = Tracker(tracking_cfg, out_dir, config, resume=False)
    try:
        tracker.log(report.flat_metrics(), step=0)
    finally:
        tracker.close()
