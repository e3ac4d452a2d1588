"""GRPO step-time breakdown on CPU: where a training step's time goes, per phase.

Runs the real trainer (Ray actors, HF rollout engine, reward pool, DeepSpeed learner over gloo)
for a few steps on the tiny judge (~0.2M parameters) and on a ~114M-parameter random Qwen2-VL,
and prints the median per-phase seconds of the steps after the first (which pays one-off costs),
plus response tokens/s and the untimed rest of the step (driver work between phases).

A second table splits each worker phase's wall time into the compute its workers measured
around their own work (the slowest worker's, per call) and the overhead around it (Ray dispatch,
object-store transfers, driver work inside the phase); its step row sets the step's wall time
against all the compute, so its overhead also holds adv, sync and the untimed rest.

    python benchmarks/bench_step.py [--steps 4] [--base-steps 2] [--prompts 4] [--ranks 1] [--tiny-only]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import ray

from pjray.config import load
from pjray.models.tiny import build_base_judge
from pjray.cluster import actor_env
from pjray.rl.trainer import COMPUTE_PHASES, Trainer

PHASES = ("gen", "reward", "adv", "ref", "update", "sync")


def run(model_path: str | None, steps: int, ranks: int, prompts: int, run_dir: Path) -> list[dict[str, float]]:
    overrides = [
        "model.init=tiny",
        f"trainer.run_dir={run_dir}",
        f"trainer.steps={steps}",
        f"trainer.prompts_per_step={prompts}",
        "algo.group_size=4",
        f"learner.num_ranks={ranks}",
        f"learner.micro_batch_size={prompts * 4 // ranks}",
        "rollout.max_new_tokens=32",
        "data.num_items=64",
        "tracking.wandb=false",
        "trainer.export_hf=false",
        "trainer.save_every=0",
    ]
    if model_path:
        overrides.append(f"model.path={model_path}")
    trainer = Trainer(load(overrides=overrides))
    rows = []
    try:
        trainer.setup()
        for trainer.step in range(1, steps + 1):
            rows.append(trainer.train_step())
    finally:
        trainer.shutdown()
    return rows


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    timed = rows[1:] or rows
    out = {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in timed) for p in PHASES}
    out["step"] = statistics.median(r["timing_s/step"] for r in timed)
    # Per step, then the median: a difference of medians would mix different steps.
    out["untimed"] = statistics.median(
        r["timing_s/step"] - sum(r.get(f"timing_s/{p}", 0.0) for p in PHASES) for r in timed
    )
    out["tokens"] = statistics.median(r["perf/total_num_tokens"] for r in timed)
    out["tok_s"] = statistics.median(r["perf/throughput"] for r in timed)
    out["gen_tok_s"] = out["tokens"] / out["gen"] if out["gen"] else 0.0
    return out


def overhead_rows(rows: list[dict[str, float]]) -> list[tuple[str, float, float | None, float]]:
    """(phase, wall, compute, overhead) medians over the steps after the first: each worker
    phase that ran, the rest of the step (no worker compute measured: all of it is overhead)
    and the step against the sum of compute. Each column is its own median, so wall - compute
    can differ from overhead by a little."""
    timed = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    phases = [p for p in COMPUTE_PHASES if f"timing_s/{p}_compute" in timed[0]]
    out: list[tuple[str, float, float | None, float]] = [
        (p, median(f"timing_s/{p}"), median(f"timing_s/{p}_compute"), median(f"timing_s/{p}_overhead"))
        for p in phases
    ]
    rest = statistics.median(r["timing_s/step"] - sum(r[f"timing_s/{p}"] for p in phases) for r in timed)
    out.append(("rest: adv, sync, untimed", rest, None, rest))
    out.append(("step", median("timing_s/step"), median("timing_s/compute"), median("timing_s/ray_overhead")))
    return out


def print_overhead(results: dict[str, list[tuple[str, float, float | None, float]]]) -> None:
    print("\nRay overhead per phase: wall time in the driver, compute inside the workers (slowest worker "
          "per call), overhead = wall - compute; median of the steps after the first; seconds")
    print("| model | phase | wall s | compute s | overhead s | overhead % |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        for phase, wall, compute, overhead in rows:
            busy = f"{compute:.3f}" if compute is not None else "-"
            share = 100 * overhead / wall if wall else 0.0
            print(f"| {name} | {phase} | {wall:.3f} | {busy} | {overhead:.3f} | {share:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x4 samples)")
    parser.add_argument("--base-steps", type=int, default=2, help="steps for the 114M judge")
    parser.add_argument("--tiny-only", action="store_true")
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": actor_env()})
    results, overheads = {}, {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run(None, args.steps, args.ranks, args.prompts, Path(tmp) / "tiny")
            results["tiny (0.2M)"], overheads["tiny (0.2M)"] = summarize(rows), overhead_rows(rows)
            if not args.tiny_only:
                base = build_base_judge(Path(tmp) / "base_model")
                rows = run(str(base), args.base_steps, args.ranks, args.prompts, Path(tmp) / "base")
                results["qwen2vl-114M"], overheads["qwen2vl-114M"] = summarize(rows), overhead_rows(rows)
    finally:
        ray.shutdown()

    print(f"\nGRPO step on CPU: {args.prompts} prompts x 4 samples, <=32 new tokens, {args.ranks} learner "
          f"rank(s); median of the steps after the first (tiny: {args.steps}, 114M: {args.base_steps} steps); seconds")
    cols = [*PHASES, "untimed", "step"]
    print("| model | " + " | ".join(cols) + " | resp tokens | tokens/s (step) | tokens/s (gen) |")
    print("|---" * (len(cols) + 4) + "|")
    for name, r in results.items():
        cells = " | ".join(f"{r[c]:.3f}" for c in cols)
        print(f"| {name} | {cells} | {r['tokens']:.0f} | {r['tok_s']:.1f} | {r['gen_tok_s']:.1f} |")
    print_overhead(overheads)


if __name__ == "__main__":
    main()
