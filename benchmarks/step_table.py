"""One row per logged step of a run: its phase timings and the figures a GPU check reads.

The GPU check scripts (`gpu_smoke.sh`, `gpu_learner_check.sh`) print it after each short
training run: every `timing_s/<phase>` wall time of the run (the weight sync among them), then
the mean reward, the gradient norm and the learner-vs-rollout log-prob differences (a stale
encoder cache after a sync, or a dtype mismatch, shows in the last two).

With `--max-diff-max X` / `--max-diff-mean X` it also checks the run: it exits non-zero (after
the table) when a step sampled by the learner's own weights (`rollout/staleness_max` 0: on-policy
steps, where engine and learner hold the same weights) has a larger log-prob difference, or
when the run logged none. Steps of older weights (async rollouts) are not checked: their gap
is the policy's change too.

Usage: python benchmarks/step_table.py RUN_DIR/metrics.jsonl [--max-diff-max X] [--max-diff-mean X]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FIGURES = ("reward/mean", "actor/grad_norm", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")
WALL_PHASES = ("timing_s/step", "timing_s/gen", "timing_s/ref", "timing_s/update", "timing_s/sync")


def columns(rows: list[dict[str, float]]) -> list[str]:
    """The wall-time phases the run logged (in the loop's order, then any other), then the
    figures it logged; the workers' compute/overhead split and its sums are left out."""
    logged = {k for row in rows for k in row}
    timings = sorted(
        k
        for k in logged
        if k.startswith("timing_s/") and k != "timing_s/compute" and not k.endswith(("_compute", "_overhead"))
    )
    timings.sort(key=lambda k: WALL_PHASES.index(k) if k in WALL_PHASES else len(WALL_PHASES))
    return timings + [k for k in FIGURES if k in logged]


def header(key: str) -> str:
    """`gen s` for a phase's wall time, the figure's own name (`reward/mean` -> `reward`) else."""
    group, name = key.split("/", 1)
    return f"{name} s" if group == "timing_s" else (group if name == "mean" else name)


def table(rows: list[dict[str, float]]) -> str:
    keys = columns(rows)
    head = f"{'step':>4} " + " ".join(f"{header(k):>17}" for k in keys)
    body = [
        f"{int(row['training/global_step']):>4} " + " ".join(f"{row.get(k, float('nan')):>17.4g}" for k in keys)
        for row in rows
    ]
    return "\n".join([head, *body])


def gap_errors(rows: list[dict[str, float]], limits: dict[str, float]) -> list[str]:
    """One line per on-policy step whose log-prob difference `key` exceeds `limits[key]`, or
    one saying the run logged no on-policy step with the figure."""
    errors = []
    for key, limit in limits.items():
        checked = [row for row in rows if row.get("rollout/staleness_max", 0.0) == 0.0 and key in row]
        if not checked:
            errors.append(f"no on-policy step logs {key}")
        errors += [
            f"step {int(row['training/global_step'])}: {key} = {row[key]:.4g} > {limit:g}"
            for row in checked
            if not row[key] <= limit
        ]
    return errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("--max-diff-max", type=float, help="fail above this rollout/logprob_diff_max")
    ap.add_argument("--max-diff-mean", type=float, help="fail above this rollout/logprob_diff_mean")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    if not rows:
        sys.exit(f"step_table: {args.metrics} logs no step")
    print(table(rows))
    limits = {
        key: limit
        for key, limit in (
            ("rollout/logprob_diff_max", args.max_diff_max),
            ("rollout/logprob_diff_mean", args.max_diff_mean),
        )
        if limit is not None
    }
    errors = gap_errors(rows, limits)
    if errors:
        sys.exit("step_table: the engine's log-probs left the learner's:\n  " + "\n  ".join(errors))


if __name__ == "__main__":
    main()
