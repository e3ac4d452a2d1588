"""Async rollouts against the synchronous loop on CPU: steps per second, held-out learning, and the
log-prob gap with its importance weights under staleness 0, 1 and 2.

    python benchmarks/bench_async.py [--steps 40] [--seeds 3] [--work runs/bench_async] [--out benchmarks/results]

Every run is the default `pjray train` (base judge, scenes, configs/demo.yaml) in one of four layouts:

| layout | what differs from the default |
|---|---|
| hybrid | nothing (the default): the learner rank generates with the module it trains |
| sync   | one learner rank and one HF rollout worker, one torch thread each (rollout.backend=hf) |
| async1 | sync with trainer.max_staleness=1: the worker generates step t+1 while the learner trains step t |
| async2 | sync with trainer.max_staleness=2 |
| sync_none | sync without rollout correction (algo.rollout_is=none) |

sync, async1 and async2 correct for the engine gap with TIS (algo.rollout_is=token, upper 2): in
sync the gap is numerical only, in async1/async2 the weights that sampled are 1 or 2 updates old.

Speed: steps per second over steps 2..N (the first pays one-off costs) of seed 0 of each layout,
run one after another on the otherwise idle machine. Learning: every run's held-out check
(`pjray.eval.looking`, image-following and correct first per kind on independent held-out tuples),
sync_none, sync and async1 over `--seeds` seeds with 95% t-intervals on the seed means (TIS against
none, async against sync). Gap: per step, the engine-vs-learner log-prob difference and the IS
weights' mean, max, fraction truncated and effective sample size.

Runs are cached by overrides, base weights and pjray's code hash (as the group-size study's), so a
rerun reuses finished runs of the same code. Writes async.{json,md} into --out. The last line
printed is `async speed-up: X.XXx over the faster synchronous layout`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pjray.config import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from group_size_study import default_run_keys, metrics_rows  # noqa: E402  (sibling scripts)
from study_looking import ensure_run, t_interval  # noqa: E402

SPLIT = ["rollout.backend=hf", "rollout.num_threads=1", "learner.num_threads=1", "algo.rollout_is=token"]
LAYOUTS: dict[str, list[str]] = {
    "hybrid": [],
    "sync": SPLIT,
    "async1": [*SPLIT, "trainer.max_staleness=1"],
    "async2": [*SPLIT, "trainer.max_staleness=2"],
    "sync_none": [*SPLIT[:-1], "algo.rollout_is=none"],
}
SYNCHRONOUS = ("hybrid", "sync", "sync_none")
LEARNING = ("sync_none", "sync", "async1")  # compared over seeds
KINDS = ("color", "size")
GAP = ("rollout/staleness_mean", "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout_is/mean",
       "rollout_is/max", "rollout_is/frac_clipped", "rollout_is/ess")  # fmt: skip
PHASES = ("gen", "reward", "ref", "update", "sync")


def plan(seeds: int) -> list[tuple[str, int]]:
    """Seed 0 of every layout first (the speed comparison, back to back), then the other seeds
    of the learning comparison."""
    return [(layout, 0) for layout in LAYOUTS] + [(layout, s) for s in range(1, seeds) for layout in LEARNING]


def speed(rows: list[dict[str, float]]) -> dict[str, float]:
    later = rows[1:]
    total = sum(r["timing_s/step"] for r in later)
    return {
        "steps_per_s": len(later) / total,
        "step_s": total / len(later),
        "phases_s": {p: statistics.fmean(r.get(f"timing_s/{p}", 0.0) for r in later) for p in PHASES},
        "gen_compute_s": statistics.fmean(r.get("timing_s/gen_compute", 0.0) for r in later),
    }


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Async rollouts against the synchronous loop",
        "",
        f"`python benchmarks/bench_async.py --steps {results['steps']} --seeds {results['seeds']}` (pjray code "
        f"{results['code'][:12]}; {results['machine']}). Every run is the default `pjray train` in one layout "
        "(see the script's docstring); sync, async1 and async2 use TIS (algo.rollout_is=token), sync_none none.",
        "",
        "## Speed (seed 0, steps 2..N)",
        "",
        "| layout | steps/s | step (s) | gen wait / gen compute (s) | reward / ref / update / sync (s) | vs faster synchronous |",
        "|---|---|---|---|---|---|",
    ]
    best = max(results["speed"][name]["steps_per_s"] for name in SYNCHRONOUS)
    for name, s in results["speed"].items():
        ph = s["phases_s"]
        rest = " / ".join(f"{ph[p]:.2f}" for p in ("reward", "ref", "update", "sync"))
        lines.append(f"| {name} | {s['steps_per_s']:.3f} | {s['step_s']:.2f} | {ph['gen']:.2f} / {s['gen_compute_s']:.2f} | "
                     f"{rest} | {s['steps_per_s'] / best:.2f}x |")  # fmt: skip
    lines += ["", "## Learning (held-out check, 95% t-intervals over seeds)", "",
              "| layout | seeds | image-following color | size | correct first color | size |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, agg in results["learning"].items():
        cells = [_ci(agg[f"{metric}_{kind}"]) for metric in ("image_following", "correct_first") for kind in KINDS]
        lines.append(f"| {name} | {agg['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "## Every run", "", "| layout | seed | image-following color | size | correct first color | size | steps/s |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["runs"]:
        lines.append(f"| {r['layout']} | {r['seed']} | " + " | ".join(
            f"{100 * r[f'{m}_{k}']:.0f}%" for m in ("image_following", "correct_first") for k in KINDS) + f" | {r['steps_per_s']:.3f} |")  # fmt: skip
    lines += ["", "## The log-prob gap and the IS weights, per step (seed 0)", "",
              "| layout | step | staleness | logprob diff mean | max | IS mean | IS max | truncated | ESS |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, per_step in results["gap"].items():
        for row in per_step:
            if row["step"] in results["gap_steps"]:
                lines.append(f"| {name} | {row['step']} | " + " | ".join(f"{row.get(k, 0.0):.4g}" for k in GAP) + " |")
    lines += ["", f"async speed-up: {results['speedup']:.2f}x over the faster synchronous layout", ""]
    return "\n".join(lines)


def _ci(c: dict[str, Any]) -> str:
    if c["lo"] is None:
        return f"{100 * c['mean']:.0f}%"
    return f"{100 * c['mean']:.0f}% [{100 * max(c['lo'], 0.0):.0f}, {100 * min(c['hi'], 1.0):.0f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the learning comparison (sync_none, sync, async1)")
    ap.add_argument("--work", default="runs/bench_async", help="run directories (reused when finished with the same key)")
    ap.add_argument("--out", default="benchmarks/results", help="where async.{json,md} go")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    judge_id, code, check = default_run_keys()
    started = time.perf_counter()
    runs, speeds, gap = [], {}, {}
    for layout, seed in plan(args.seeds):
        overrides = [*LAYOUTS[layout], f"trainer.steps={args.steps}", f"trainer.seed={seed}"]
        run_dir = work / f"{layout}-n{args.steps}-s{seed}"
        key = {"overrides": overrides, "base_weights": judge_id, "code": code}
        run_cfg = load(None, [*overrides, f"trainer.run_dir={run_dir}", "tracking.wandb=false",
                              "tracking.group=bench_async", "trainer.save_every=0"])  # fmt: skip
        seconds, reused = ensure_run(run_dir, key, run_cfg, held_out=check)
        rows = metrics_rows(run_dir)
        looks = json.loads((run_dir / "held_out.json").read_text())["trained"]["looks"]
        s = speed(rows)
        runs.append({"layout": layout, "seed": seed, "run_s": round(seconds, 1), "steps_per_s": s["steps_per_s"],
                     **{f"{m}_{k}": looks[k][m] for m in ("image_following", "correct_first") for k in KINDS}})  # fmt: skip
        if seed == 0:
            speeds[layout] = s
            if layout not in ("hybrid", "sync_none"):
                gap[layout] = [{"step": int(r["step"]), **{k: r.get(k, 0.0) for k in GAP}} for r in rows]
        print(f"{'reused' if reused else 'trained'} {layout} seed {seed} ({seconds:.0f}s): {s['steps_per_s']:.3f} steps/s, "
              f"image-following color {100 * looks['color']['image_following']:.0f}% size {100 * looks['size']['image_following']:.0f}%",
              flush=True)  # fmt: skip
    learning = {}
    for layout in LEARNING:
        mine = [r for r in runs if r["layout"] == layout]
        learning[layout] = {"seeds": len(mine), **{f"{m}_{k}": {**t_interval([r[f"{m}_{k}"] for r in mine])}
                                                   for m in ("image_following", "correct_first") for k in KINDS}}  # fmt: skip
    best = max(speeds[name]["steps_per_s"] for name in SYNCHRONOUS)
    results = {
        "code": code, "base_weights": judge_id, "machine": f"{os.cpu_count()} CPUs, no GPU", "steps": args.steps,
        "seeds": args.seeds, "speed": speeds, "learning": learning, "runs": runs, "gap": gap,
        "gap_steps": sorted({1, 2, 3, 5, *range(10, args.steps + 1, 10), args.steps}),
        "speedup": speeds["async1"]["steps_per_s"] / best, "bench_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    (out / "async.json").write_text(json.dumps(results, indent=1))
    (out / "async.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
