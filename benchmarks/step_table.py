"""One row per logged step of a run: its phase timings and the figures a GPU check reads.

The GPU check scripts (`gpu_smoke.sh`, `gpu_learner_check.sh`) print it after each short
training run: every `timing_s/<phase>` wall time of the run (the weight sync among them), then
the mean reward, the gradient norm and the learner-vs-rollout log-prob differences (a stale
encoder cache after a sync, or a dtype mismatch, shows in the last two).

Usage: python benchmarks/step_table.py RUN_DIR/metrics.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIGURES = ("reward/mean", "actor/grad_norm", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")
WALL_PHASES = ("timing_s/step", "timing_s/gen", "timing_s/ref", "timing_s/update", "timing_s/sync")


def columns(rows: list[dict[str, float]]) -> list[str]:
    """The wall-time phases the run logged (in the loop's order, then any other), then the
    figures it logged; the workers' compute/overhead split and its sums are left out."""
    logged = {k for row in rows for k in row}
    timings = sorted(k for k in logged if k.startswith("timing_s/") and k != "timing_s/compute"
                     and not k.endswith(("_compute", "_overhead")))  # fmt: skip
    timings.sort(key=lambda k: WALL_PHASES.index(k) if k in WALL_PHASES else len(WALL_PHASES))
    return timings + [k for k in FIGURES if k in logged]


def header(key: str) -> str:
    """`gen s` for a phase's wall time, the figure's own name (`reward/mean` -> `reward`) else."""
    group, name = key.split("/", 1)
    return f"{name} s" if group == "timing_s" else (group if name == "mean" else name)


def table(rows: list[dict[str, float]]) -> str:
    keys = columns(rows)
    head = f"{'step':>4} " + " ".join(f"{header(k):>17}" for k in keys)
    body = [f"{int(row['training/global_step']):>4} " + " ".join(f"{row.get(k, float('nan')):>17.4g}" for k in keys)
            for row in rows]  # fmt: skip
    return "\n".join([head, *body])


def main(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        sys.exit(f"step_table: {path} logs no step")
    print(table(rows))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    main(sys.argv[1])
