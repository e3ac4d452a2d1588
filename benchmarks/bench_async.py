"""Async rollouts against the synchronous loop on CPU: steps per second, held-out learning, and the
log-prob gap with its importance weights under staleness 0, 1 and 2.

    python benchmarks/bench_async.py [--steps 40] [--seeds 3] [--repeats 3] [--work runs/bench_async] [--out benchmarks/results]
    python benchmarks/bench_async.py --quick     # sync and async1 only, 8 steps, 3 repeats, no learning (~5 min)

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
`--repeats` runs each, interleaved (layout by layout, repeat after repeat) on the otherwise idle
machine: the median and the range. The bound: from the sync runs' own phases, generation
t_gen (the wall time of the gen phase) and the rest of the step t_train (reward, ref, update,
sync), the most any overlap of the two can gain with the same threads is
(t_gen + t_train) / max(t_gen, t_train); the async speed-up is reported as a fraction of it. Learning: every run's held-out check
(`pjray.eval.looking`, image-following and correct first per kind on independent held-out tuples),
sync_none, sync and async1 over `--seeds` seeds with 95% t-intervals on the seed means (TIS against
none, async against sync). Gap: per step, the engine-vs-learner log-prob difference and the IS
weights' mean, max, fraction truncated and effective sample size.

Runs are cached by overrides, base weights and pjray's code hash (as the group-size study's), so a
rerun reuses finished runs of the same code. Writes async.{json,md} into --out. The last line
printed is one JSON line: `{"speedup_median", "speedup_range", "bound", "fraction_of_bound", "runs"}`
(async1 against sync, same threads).
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
GAP = (
    "rollout/staleness_mean",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "rollout_is/mean",
    "rollout_is/max",
    "rollout_is/frac_clipped",
    "rollout_is/ess",
)
PHASES = ("gen", "reward", "ref", "update", "sync")


def plan(layouts: list[str], seeds: int, repeats: int) -> list[tuple[str, int, int]]:
    """(layout, seed, repeat): seed 0 of every layout `repeats` times first (the speed
    comparison, back to back and interleaved), then the other seeds of the learning comparison."""
    speed_runs = [(layout, 0, r) for r in range(repeats) for layout in layouts]
    return speed_runs + [(layout, s, 0) for s in range(1, seeds) for layout in LEARNING if layout in layouts]


def overlap_bound(sync: dict[str, Any]) -> dict[str, float]:
    """The most overlapping generation with the rest of the step can gain over a synchronous
    step of these phases: (t_gen + t_train) / max(t_gen, t_train)."""
    gen = sync["phases_s"]["gen"]
    rest = sync["step_s"] - gen
    return {"t_gen_s": gen, "t_train_s": rest, "bound": sync["step_s"] / max(gen, rest)}


def speed(rows: list[dict[str, float]]) -> dict[str, float]:
    later = rows[1:]
    total = sum(r["timing_s/step"] for r in later)
    return {
        "steps_per_s": len(later) / total,
        "step_s": total / len(later),
        "phases_s": {p: statistics.fmean(r.get(f"timing_s/{p}", 0.0) for r in later) for p in PHASES},
        "gen_compute_s": statistics.fmean(r.get("timing_s/gen_compute", 0.0) for r in later),
    }


def median_speed(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median steps/s, with the range over all repeats beside it."""
    ordered = sorted(reps, key=lambda s: s["steps_per_s"])
    mid = ordered[(len(ordered) - 1) // 2]
    return {**mid, "steps_per_s_range": [ordered[0]["steps_per_s"], ordered[-1]["steps_per_s"]]}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Async rollouts against the synchronous loop",
        "",
        f"`python benchmarks/bench_async.py --steps {results['steps']} --seeds {results['seeds']}` (pjray code "
        f"{results['code'][:12]}; {results['machine']}). Every run is the default `pjray train` in one layout "
        "(see the script's docstring); sync, async1 and async2 use TIS (algo.rollout_is=token), sync_none none.",
        "",
        f"## Speed (seed 0, steps 2..N, the median of {results['repeats']} runs each)",
        "",
        "| layout | steps/s | range | step (s) | gen wait / gen compute (s) | reward / ref / update / sync (s) | vs faster synchronous |",
        "|---|---|---|---|---|---|---|",
    ]
    best = max(results["speed"][name]["steps_per_s"] for name in SYNCHRONOUS)
    for name, s in results["speed"].items():
        ph = s["phases_s"]
        rest = " / ".join(f"{ph[p]:.2f}" for p in ("reward", "ref", "update", "sync"))
        lo, hi = s["steps_per_s_range"]
        lines.append(
            f"| {name} | {s['steps_per_s']:.3f} | {lo:.3f}-{hi:.3f} | {s['step_s']:.2f} | {ph['gen']:.2f} / "
            f"{s['gen_compute_s']:.2f} | {rest} | {s['steps_per_s'] / best:.2f}x |"
        )
    lines += [
        "",
        f"async1 over sync, per repeat pair: median {results['speedup_median']:.2f}x (range "
        f"{results['speedup_range'][0]:.2f}-{results['speedup_range'][1]:.2f}); the overlap bound of sync's phases "
        f"(t_gen {results['t_gen_s']:.2f} s, the rest {results['t_train_s']:.2f} s) is {results['bound']:.2f}x: "
        f"{results['fraction_of_bound']:.0%} of it.",
    ]
    lines += [
        "",
        "## Learning (held-out check, 95% t-intervals over seeds)",
        "",
        "| layout | seeds | image-following color | size | correct first color | size |",
        "|---|---|---|---|---|---|",
    ]
    for name, agg in results["learning"].items():
        cells = [_ci(agg[f"{metric}_{kind}"]) for metric in ("image_following", "correct_first") for kind in KINDS]
        lines.append(f"| {name} | {agg['seeds']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Every run",
        "",
        "| layout | seed | image-following color | size | correct first color | size | steps/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['layout']} | {r['seed']} | "
            + " | ".join(f"{100 * r[f'{m}_{k}']:.0f}%" for m in ("image_following", "correct_first") for k in KINDS)
            + f" | {r['steps_per_s']:.3f} |"
        )
    lines += [
        "",
        "## The log-prob gap and the IS weights, per step (seed 0)",
        "",
        "| layout | step | staleness | logprob diff mean | max | IS mean | IS max | truncated | ESS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
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
    ap.add_argument(
        "--work", default="runs/bench_async", help="run directories (reused when finished with the same key)"
    )
    ap.add_argument("--out", default="benchmarks/results", help="where async.{json,md} go")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each layout's seed 0 for the speed comparison")
    ap.add_argument(
        "--quick", action="store_true", help="sync and async1 only, 8 steps, one seed; writes nothing to --out"
    )
    args = ap.parse_args(argv)
    layouts = ["sync", "async1"] if args.quick else list(LAYOUTS)
    if args.quick:
        args.steps, args.seeds = 8, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    judge_id, code, check = default_run_keys()
    started = time.perf_counter()
    runs, repeats, gap = [], {}, {}
    for layout, seed, repeat in plan(layouts, args.seeds, args.repeats):
        overrides = [*LAYOUTS[layout], f"trainer.steps={args.steps}", f"trainer.seed={seed}"]
        run_dir = (
            work / f"{layout}-n{args.steps}-s{seed}"
            if repeat == 0
            else work / f"{layout}-n{args.steps}-s{seed}-r{repeat}"
        )
        key = {"overrides": overrides, "base_weights": judge_id, "code": code, "repeat": repeat}
        run_cfg = load(
            None,
            [
                *overrides,
                f"trainer.run_dir={run_dir}",
                "tracking.wandb=false",
                "tracking.group=bench_async",
                "trainer.save_every=0",
            ],
        )
        seconds, reused = ensure_run(run_dir, key, run_cfg, held_out=None if args.quick else check)
        rows = metrics_rows(run_dir)
        s = speed(rows)
        if seed == 0:
            repeats.setdefault(layout, []).append(s)
        if repeat:
            print(
                f"{'reused' if reused else 'trained'} {layout} repeat {repeat} ({seconds:.0f}s): {s['steps_per_s']:.3f} steps/s",
                flush=True,
            )
            continue
        if seed == 0 and layout not in ("hybrid", "sync_none"):
            gap[layout] = [{"step": int(r["step"]), **{k: r.get(k, 0.0) for k in GAP}} for r in rows]
        looks = {} if args.quick else json.loads((run_dir / "held_out.json").read_text())["trained"]["looks"]
        runs.append(
            {
                "layout": layout,
                "seed": seed,
                "run_s": round(seconds, 1),
                "steps_per_s": s["steps_per_s"],
                **{f"{m}_{k}": looks[k][m] for m in ("image_following", "correct_first") for k in KINDS if looks},
            }
        )
        print(
            f"{'reused' if reused else 'trained'} {layout} seed {seed} ({seconds:.0f}s): {s['steps_per_s']:.3f} steps/s"
            + (
                ""
                if args.quick
                else f", image-following color {100 * looks['color']['image_following']:.0f}% "
                f"size {100 * looks['size']['image_following']:.0f}%"
            ),
            flush=True,
        )
    speeds = {layout: median_speed(reps) for layout, reps in repeats.items()}
    ratios = sorted(a["steps_per_s"] / b["steps_per_s"] for a, b in zip(repeats["async1"], repeats["sync"]))
    bound = overlap_bound(speeds["sync"])
    summary = {
        "speedup_median": statistics.median(ratios),
        "speedup_range": [ratios[0], ratios[-1]],
        "bound": bound["bound"],
        "fraction_of_bound": statistics.median(ratios) / bound["bound"],
        "t_gen_s": bound["t_gen_s"],
        "t_train_s": bound["t_train_s"],
        "runs": len(ratios),
    }
    if args.quick:
        for layout, s in speeds.items():
            lo, hi = s["steps_per_s_range"]
            print(
                f"{layout:<7} {s['steps_per_s']:.3f} steps/s (median of {len(repeats[layout])}, range {lo:.3f}-{hi:.3f})"
            )
        print(json.dumps(summary))
        return 0
    learning = {}
    for layout in LEARNING:
        mine = [r for r in runs if r["layout"] == layout]
        learning[layout] = {
            "seeds": len(mine),
            **{
                f"{m}_{k}": {**t_interval([r[f"{m}_{k}"] for r in mine])}
                for m in ("image_following", "correct_first")
                for k in KINDS
            },
        }
    best = max(speeds[name]["steps_per_s"] for name in SYNCHRONOUS)
    results = {
        "code": code,
        "base_weights": judge_id,
        "machine": f"{os.cpu_count()} CPUs, no GPU",
        "steps": args.steps,
        "seeds": args.seeds,
        "repeats": args.repeats,
        "speed": speeds,
        "learning": learning,
        "runs": runs,
        "gap": gap,
        "gap_steps": sorted({1, 2, 3, 5, *range(10, args.steps + 1, 10), args.steps}),
        "speedup": speeds["async1"]["steps_per_s"] / best,
        **summary,
        "bench_s": round(time.perf_counter() - started, 1),
    }
    (out / "async.json").write_text(json.dumps(results, indent=1))
    (out / "async.md").write_text(markdown(results))
    print(markdown(results))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
