"""The group-size study: what GRPO's group size G buys a judge, and what it costs.

    python benchmarks/group_size_study.py              # every run below (about 2 h on 2 cores)
    python benchmarks/group_size_study.py --report     # re-render .md and .png from group_size.json
    python benchmarks/group_size_study.py --smoke      # every stage on a few steps (a test, not a study)
    ray job submit --working-dir . -- python benchmarks/group_size_study.py   # the same, as a Ray job

Runs, each an ordinary `pjray train` of the default base judge and data (configs/demo.yaml) with
its held-out check (`pjray.eval.looking`: image-following on 120 independent held-out tuples,
letters balanced, with its nulls), differing only in G, prompts per step, steps and seed:

| budget | G | prompts per step | responses per step | steps | seeds |
|---|---|---|---|---|---|
| equal_samples | 2, 4, 8, 16, 32 | 64 / G | 64 | 40 (the default run's) | 0-4 |
| equal_prompts | 2, 4, 8, 16 | 8 | 8 G | 40 | 0-2 |
| long | 2, 4, 8, 16, 32 | 64 / G | 64 | 160 | 0 |

The committed group_size.* were measured when the default was the base judge of
`model.init=base_judge` on nested colour and size tuples at lr 3e-4 (Levenshtein, no prefilter);
a rerun now trains from the shipped one-disposition judge with today's defaults.

G = 8 with 8 prompts is both the equal-samples and the equal-prompts run (one config): its seeds
0-2 are trained once and listed under both budgets. "long" tells "more samples" from "more steps":
at equal samples a step, G only changes how the 64 responses are spread over prompts.

A run directory is reused only when its `study_run.json` holds the same key: the run's overrides,
the base judge's weights (hash) and pjray's code (`pjray.cache.code_hash`), so no run of other
code is reused; a started run of the same key resumes from its checkpoint.

Per run and kind (color, size, pooled): held-out image-following (and its Wilson interval) and
correct first; per run: the reward curve, the fraction of groups whose rewards all equal (no
gradient), the median step time and its phases, responses per second and the time in training
steps (at the median step: steps x its time, the wall time the plots use; a run's set-up, exports
and held-out check add about the same to every run), the peak host memory of each role (the
driver's is the study process's, which trains every run: its peak only grows). Seed intervals are 95% t-intervals on the seed
means. Writes group_size.{json,md,png} into benchmarks/results (or --out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pjray.cache import code_hash
from pjray.config import Config, load
from pjray.recipes.base_judge import RECIPES, base_judge, weights_sha256

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_looking import ensure_run, t_interval  # noqa: E402  (a sibling script)

SAMPLES_PER_STEP = 64
PROMPTS = 8
KINDS = ("color", "size", "pooled")
PHASES = ("gen", "reward", "ref", "update", "sync")
ROLES = ("driver", "learner", "reward", "rollout")
NULL = 0.25  # image-following of a judge that drops the self-contradicting answer (1/(K-1)^2, K = 3)


@dataclasses.dataclass(frozen=True)
class Run:
    budget: str  # equal_samples | equal_prompts | long
    group_size: int
    prompts_per_step: int
    steps: int
    seed: int

    @property
    def name(self) -> str:
        return f"G{self.group_size}-p{self.prompts_per_step}-n{self.steps}-s{self.seed}"

    @property
    def overrides(self) -> list[str]:
        return [
            f"algo.group_size={self.group_size}",
            f"trainer.prompts_per_step={self.prompts_per_step}",
            f"trainer.steps={self.steps}",
            f"trainer.seed={self.seed}",
        ]


def plan(steps: int = 40, long_steps: int = 160, seeds: int = 5, prompt_seeds: int = 3) -> list[Run]:
    """Every run of the study, seed-major (a partial study covers every G), then equal prompts,
    then the long runs. The equal-prompts G = 8 runs are the equal-samples ones (not repeated)."""
    runs = [Run("equal_samples", g, SAMPLES_PER_STEP // g, steps, s) for s in range(seeds) for g in (2, 4, 8, 16, 32)]
    runs += [Run("equal_prompts", g, PROMPTS, steps, s) for s in range(prompt_seeds) for g in (2, 4, 16)]
    runs += [Run("long", g, SAMPLES_PER_STEP // g, long_steps, 0) for g in (2, 4, 8, 16, 32)]
    return runs


def smoke_plan() -> list[Run]:
    return [Run("equal_samples", 2, 4, 2, 0), Run("equal_samples", 4, 2, 2, 0), Run("equal_prompts", 8, 2, 2, 0)]


SMOKE_OVERRIDES = ["data.num_items=16", "rollout.max_new_tokens=48", "learner.micro_batch_size=8"]


def budgets_of(run: Run) -> list[str]:
    """The budgets a run stands in: G = 8 at 8 prompts and the default steps is both."""
    if run.budget == "equal_samples" and run.prompts_per_step == PROMPTS and run.seed < 3:
        return ["equal_samples", "equal_prompts"]
    return [run.budget]


def run_config(run: Run, run_dir: Path, extra: list[str]) -> Config:
    return load(
        None,
        [
            *run.overrides,
            *extra,
            f"trainer.run_dir={run_dir}",
            "tracking.wandb=false",
            "tracking.group=group_size_study",
            "trainer.save_every=0",
        ],
    )


def finished(run_dir: Path, key: dict[str, Any]) -> bool:
    """Whether `run_dir` holds a finished run of `key` (what `ensure_run` would reuse)."""
    marker = run_dir / "study_run.json"
    if not marker.exists() or not (run_dir / "hf_model" / "COMPLETE").exists():
        return False
    return json.loads(marker.read_text())["key"] == json.loads(json.dumps(key))


# --------------------------------------------------------------------------- one run's numbers
def metrics_rows(run_dir: Path) -> list[dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows[int(record["step"])] = record
    return [rows[s] for s in sorted(rows)]


def run_summary(run: Run, run_dir: Path, train_seconds: float) -> dict[str, Any]:
    """The per-run numbers (everything but the per-kind held-out ones)."""
    rows = metrics_rows(run_dir)
    step_s = statistics.median(r["timing_s/step"] for r in rows)
    responses = run.group_size * run.prompts_per_step
    out: dict[str, Any] = {
        "G": run.group_size,
        "prompts_per_step": run.prompts_per_step,
        "responses_per_step": responses,
        "steps": run.steps,
        "seed": run.seed,
        "responses_consumed": responses * run.steps,
        "zero_variance_groups": statistics.fmean(r["rollout/frac_zero_std"] for r in rows),
        # Timing at the median step: robust to a step slowed by other work on the machine.
        "step_s": step_s,
        "responses_per_s": responses / step_s,
        # The time in training steps (the x of "against wall time"): set-up, exports and the
        # held-out check cost about the same for every G and are left out.
        "train_wall_s": round(step_s * len(rows), 1),
        "run_s": round(train_seconds, 1),
        "reward_first5": statistics.fmean(r["reward/mean"] for r in rows[:5]),
        "reward_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:]),
        "reward_curve": [round(r["reward/mean"], 4) for r in rows],
        "phases_s": {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in rows) for p in PHASES},
        "peak_mib": {role: max(r.get(f"memory/{role}_peak_mib", 0.0) for r in rows) for role in ROLES},
    }
    return out


def kind_rows(run: Run, summary: dict[str, Any], held_out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per budget the run stands in and per kind, with the held-out numbers."""
    rows = []
    looks = held_out["trained"]["looks"]
    for budget in budgets_of(run):
        for kind in KINDS:
            k = looks[kind]
            rows.append(
                {
                    "budget": budget,
                    "kind": kind,
                    **{key: v for key, v in summary.items() if key not in ("reward_curve",)},
                    "image_following": k["image_following"],
                    "image_following_ci": k["image_following_ci"],
                    "correct_first": k["correct_first"],
                    "disposition_image": k["disposition_image"],
                    "base_forced_image_following": held_out["base"]["looks"][kind]["forced"]["image_following"],
                    "items": k["items"],
                }
            )
    return rows


# --------------------------------------------------------------------------- across seeds
def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (budget, G, kind): t-intervals over seeds of image-following and correct first, and
    the means of the cost columns."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["budget"], r["G"], r["kind"]), []).append(r)
    out = []
    for (budget, g, kind), rs in sorted(groups.items(), key=lambda x: (x[0][0], x[0][1], KINDS.index(x[0][2]))):
        out.append(
            {
                "budget": budget,
                "G": g,
                "kind": kind,
                "seeds": sorted(r["seed"] for r in rs),
                "prompts_per_step": rs[0]["prompts_per_step"],
                "steps": rs[0]["steps"],
                "responses_consumed": rs[0]["responses_consumed"],
                "image_following": {**t_interval([r["image_following"] for r in rs]), "n": len(rs)},
                "correct_first": {**t_interval([r["correct_first"] for r in rs]), "n": len(rs)},
                "disposition_image": float(np.mean([r["disposition_image"] for r in rs])),
                "zero_variance_groups": float(np.mean([r["zero_variance_groups"] for r in rs])),
                "step_s": float(np.mean([r["step_s"] for r in rs])),
                "responses_per_s": float(np.mean([r["responses_per_s"] for r in rs])),
                "train_wall_s": float(np.mean([r["train_wall_s"] for r in rs])),
                "reward_first5": float(np.mean([r["reward_first5"] for r in rs])),
                "reward_last5": float(np.mean([r["reward_last5"] for r in rs])),
                "base_forced_image_following": rs[0]["base_forced_image_following"],
                "phases_s": {p: float(np.mean([r["phases_s"][p] for r in rs])) for p in PHASES},
                "peak_mib": {role: float(np.max([r["peak_mib"][role] for r in rs])) for role in ROLES},
            }
        )
    return out


# --------------------------------------------------------------------------- report
def _ci(c: dict[str, Any]) -> str:
    """A seed mean with its t-interval, the interval shown within [0, 100]% (a rate's bounds)."""
    if c["lo"] is None:
        return f"{100 * c['mean']:.0f}%"
    return f"{100 * c['mean']:.0f}% [{100 * max(c['lo'], 0.0):.0f}, {100 * min(c['hi'], 1.0):.0f}]"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Group-size study",
        "",
        f"`python benchmarks/group_size_study.py` (pjray code {results['code'][:12]}; {results['machine']}). "
        "Every run is the default `pjray train` (base judge, scenes, 40 steps) with G, prompts per step, "
        "steps and seed changed; held-out numbers are the run's held-out check (`pjray.eval.looking`, "
        f"{results['items_per_kind']} tuples a kind). Image-following null (drop the self-contradicting answer, guess per image): "
        f"{100 * NULL:.0f}%. Intervals: 95% t-intervals on the seed means. The base judge forced onto "
        '"by the image" reaches ' + ", ".join(f"{k} {100 * v:.0f}%" for k, v in results["base_forced"].items()) + ".",
        "",
    ]
    for budget, title in (
        ("equal_samples", "Equal samples per step (64 responses: 64/G prompts), 40 steps"),
        ("equal_prompts", "Equal prompts per step (8 prompts: 8G responses), 40 steps"),
        ("long", "Equal samples per step, 160 steps (one seed)"),
    ):
        agg = [a for a in results["aggregate"] if a["budget"] == budget]
        if not agg:
            continue
        lines += [
            f"## {title}",
            "",
            '| G | prompts | seeds | image-following color | size | correct first color | size | "by the image" | '
            "zero-variance groups | step (s) | gen / reward / ref / update / sync (s) | responses/s | "
            "reward first 5 -> last 5 | peak MiB learner / reward |",
            "|" + "---|" * 14,
        ]
        for g in sorted({a["G"] for a in agg}):
            by_kind = {a["kind"]: a for a in agg if a["G"] == g}
            c, s = by_kind["color"], by_kind["size"]
            ph = " / ".join(f"{c['phases_s'][p]:.2f}" for p in PHASES)
            mem = " / ".join(f"{c['peak_mib'][r]:.0f}" for r in ("learner", "reward"))
            lines.append(
                f"| {g} | {c['prompts_per_step']} | {len(c['seeds'])} | {_ci(c['image_following'])} | "
                f"{_ci(s['image_following'])} | {_ci(c['correct_first'])} | {_ci(s['correct_first'])} | "
                f"{100 * by_kind['pooled']['disposition_image']:.0f}% | "
                f"{100 * c['zero_variance_groups']:.0f}% | {c['step_s']:.2f} | {ph} | {c['responses_per_s']:.1f} | "
                f"{c['reward_first5']:.3f} -> {c['reward_last5']:.3f} | {mem} |"
            )
        lines.append("")
    if results.get("missing"):
        lines += [f"Not run yet: {', '.join(results['missing'])}.", ""]
    lines += [
        "## Every run",
        "",
        '| budget | G | prompts | steps | seed | image-following color | size | correct first color | size | "by the image" | zero-variance groups | step (s) | responses/s |',
        "|" + "---|" * 13,
    ]
    per_run: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in results["rows"]:
        per_run.setdefault((r["budget"], r["G"], r["steps"], r["seed"]), {})[r["kind"]] = r
    for (budget, g, steps, seed), kinds in sorted(per_run.items()):
        c, s = kinds["color"], kinds["size"]
        lines.append(
            f"| {budget} | {g} | {c['prompts_per_step']} | {steps} | {seed} | {100 * c['image_following']:.0f}% | "
            f"{100 * s['image_following']:.0f}% | {100 * c['correct_first']:.0f}% | {100 * s['correct_first']:.0f}% | "
            f"{100 * kinds['pooled']['disposition_image']:.0f}% | "
            f"{100 * c['zero_variance_groups']:.0f}% | {c['step_s']:.2f} | {c['responses_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def bar(c: dict[str, Any]) -> tuple[float, float]:
    """Error-bar lengths below and above a seed mean, in %, the interval within [0, 100]."""
    if c["lo"] is None:
        return 0.0, 0.0
    return 100 * (c["mean"] - max(c["lo"], 0.0)), 100 * (min(c["hi"], 1.0) - c["mean"])


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out image-following (color, size) against G, responses consumed and training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharey=True)
    styles = {
        "equal_samples": ("o-", "64 responses/step, 40 steps"),
        "equal_prompts": ("s--", "8 prompts/step, 40 steps"),
        "long": ("^:", "64 responses/step, 160 steps"),
    }
    for row, kind in enumerate(("color", "size")):
        for col, (xkey, xlabel) in enumerate(
            (
                ("G", "group size G"),
                ("responses_consumed", "responses consumed"),
                ("train_wall_s", "time in training steps (s)"),
            )
        ):
            ax = axes[row][col]
            for budget, (style, label) in styles.items():
                agg = sorted(
                    (a for a in results["aggregate"] if a["budget"] == budget and a["kind"] == kind),
                    key=lambda a: a[xkey],
                )
                if not agg:
                    continue
                x = [a[xkey] for a in agg]
                y = [100 * a["image_following"]["mean"] for a in agg]
                lo, hi = zip(*(bar(a["image_following"]) for a in agg))
                ax.errorbar(x, y, yerr=[lo, hi], fmt=style, capsize=3, label=label)
                if xkey != "train_wall_s":
                    for a, xv, yv in zip(agg, x, y):
                        ax.annotate(f"G{a['G']}", (xv, yv), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.axhline(100 * NULL, color="grey", lw=0.8, ls="--", label="null (25%)")
            ax.axhline(100 * results["base_forced"][kind], color="red", lw=0.8, ls=":", label="base judge forced")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            if col == 0:
                ax.set_ylabel(f"{kind}: image-following (%)")
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Held-out image-following against group size, samples and time (95% t-intervals over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path, name: str) -> None:
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, out / f"{name}.png")


# --------------------------------------------------------------------------- main
def default_run_keys() -> tuple[str, str, Any]:
    """What a cached run of the default base judge is keyed by (its weights' hash and pjray's
    code hash), and the held-out check every run ends with."""
    from pjray.eval.held_out import held_out_check

    cfg = load(None, [])
    recipe = RECIPES[cfg.model.init]
    return weights_sha256(base_judge(cfg, recipe))[:16], code_hash(), partial(held_out_check, recipe=recipe)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="three tiny runs through every stage (a test, not a study)")
    ap.add_argument("--parts", default="equal_samples,equal_prompts,long", help="comma-separated budgets to run")
    ap.add_argument("--out", default="benchmarks/results", help="where <name>.{json,md,png} go")
    ap.add_argument("--name", default="group_size", help="the output files' stem")
    ap.add_argument(
        "--work", default="runs/group_size_study", help="run directories (reused when finished with the same key)"
    )
    ap.add_argument("--report", action="store_true", help="only re-render <name>.md and .png from <name>.json")
    ap.add_argument(
        "--finished-only",
        action="store_true",
        help="train nothing: report the runs already finished with their key, list the others as missing",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        write_report(json.loads((out / f"{args.name}.json").read_text()), out, args.name)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    runs = smoke_plan() if args.smoke else [r for r in plan() if r.budget in parts]
    extra = SMOKE_OVERRIDES if args.smoke else []
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    judge_id, code, check = default_run_keys()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    held_out_items = 0
    base_forced: dict[str, float] = {}
    missing: list[str] = []
    for index, run in enumerate(runs, start=1):
        run_dir = work / run.name
        key = {"overrides": [*run.overrides, *extra], "base_weights": judge_id, "code": code}
        if args.finished_only and not finished(run_dir, key):
            missing.append(run.name)
            continue
        seconds, reused = ensure_run(run_dir, key, run_config(run, run_dir, extra), held_out=check)
        held_out = json.loads((run_dir / "held_out.json").read_text())
        held_out_items = held_out["per_kind"]
        base_forced = {k: held_out["base"]["looks"][k]["forced"]["image_following"] for k in KINDS}
        summary = run_summary(run, run_dir, seconds)
        rows += kind_rows(run, summary, held_out)
        looks = held_out["trained"]["looks"]
        print(
            f"[{index}/{len(runs)}] {'reused' if reused else 'trained'} {run.budget} {run.name} ({seconds:.0f}s): "
            f"image-following color {100 * looks['color']['image_following']:.0f}% size {100 * looks['size']['image_following']:.0f}%, "
            f"step {summary['step_s']:.2f}s",
            flush=True,
        )
    results = {
        "code": code,
        "base_weights": judge_id,
        "machine": f"{__import__('os').cpu_count()} CPUs, no GPU",
        "items_per_kind": held_out_items,
        "base_forced": base_forced,
        "null_image_following": NULL,
        "runs": [dataclasses.asdict(r) for r in runs],
        "missing": missing,
        "rows": rows,
        "aggregate": aggregate(rows),
        "study_s": round(time.perf_counter() - started, 1),
    }
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    write_report(results, out, args.name)
    print((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
