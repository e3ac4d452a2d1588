"""GRPO step-time breakdown on CPU: where a training step's time goes, per phase and layout.

Runs the real trainer (Ray actors, HF engine, reward pool, DeepSpeed learner over gloo) for a few
steps on the tiny judge (~0.2M parameters) and on a ~114M-parameter random Qwen2-VL, in three
layouts: `split-1t` (a rollout worker beside the learner, one torch thread per actor, one
learner forward per sequence: the layout before the hybrid engine), `split` (the same with each
actor's threads from its node's cores, and each group's prompt forwarded once by the learner),
`hybrid-rows` (the learner rank generates with the module it trains, one learner forward per
sequence) and `hybrid` (the same with the prompt forwarded once per group: the CPU default). Prints
the median per-phase seconds of the steps after the first (which pays one-off costs), response
tokens/s, the untimed rest of the step (driver work between phases), and each process's peak
resident memory (the learner rank holds the policy, its optimizer state and the reference
model; a split layout's rollout worker holds one more copy of the policy).

A second table splits each worker phase's wall time into the compute its workers measured
around their own work (the slowest worker's, per call) and the overhead around it (Ray dispatch,
object-store transfers, driver work inside the phase); its step row sets the step's wall time
against all the compute, so its overhead also holds adv, sync and the untimed rest.

    python benchmarks/bench_step.py [--steps 4] [--base-steps 2] [--prompts 4] [--ranks 1] [--tiny-only]
        [--layouts split-1t,split,hybrid-rows,hybrid]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

import ray

from pjray.cluster import actor_env
from pjray.config import load
from pjray.models.tiny import build_base_judge
from pjray.recipes.training import training_inputs
from pjray.rl.timer import COMPUTE_PHASES
from pjray.rl.trainer import Trainer

PHASES = ("gen", "reward", "adv", "ref", "update", "sync")

LAYOUTS = {
    "split-1t": ["rollout.backend=hf", "rollout.num_threads=1", "learner.num_threads=1", "learner.shared_prefix=false"],
    "split": ["rollout.backend=hf"],
    "hybrid-rows": ["rollout.backend=hybrid", "learner.shared_prefix=false"],
    "hybrid": ["rollout.backend=hybrid"],
}


def peak_rss_mb(actor) -> float:
    """The actor process's peak resident memory (ru_maxrss, KiB on Linux), in MiB."""
    return ray.get(actor.__ray_call__.remote(lambda _: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)) / 1024


def run(
    model_path: str | None, steps: int, ranks: int, prompts: int, run_dir: Path, layout: str
) -> tuple[list[dict[str, float]], dict[str, float]]:
    overrides = LAYOUTS[layout] + [
        "model.init=tiny",
        "algo.prefilter_zero_std=false",
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
    cfg = load(overrides=overrides)
    trainer = Trainer(cfg, training_inputs(cfg))
    rows = []
    try:
        trainer.setup()
        for trainer.step in range(1, steps + 1):
            rows.append(trainer.train_step())
        memory = {"learner": max(peak_rss_mb(a) for a in trainer.learners)}
        if not layout.startswith("hybrid"):
            memory["rollout"] = max(peak_rss_mb(a) for a in trainer.rollout.actors)
    finally:
        trainer.shutdown()
    return rows, memory


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
    out["padding"] = statistics.median(r["perf/padding_fraction"] for r in timed)
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
        (p, median(f"timing_s/{p}"), median(f"timing_s/{p}_compute"), median(f"timing_s/{p}_overhead")) for p in phases
    ]
    rest = statistics.median(r["timing_s/step"] - sum(r[f"timing_s/{p}"] for p in phases) for r in timed)
    out.append(("rest: adv, sync, untimed", rest, None, rest))
    out.append(("step", median("timing_s/step"), median("timing_s/compute"), median("timing_s/ray_overhead")))
    return out


def print_overhead(results: dict[str, list[tuple[str, float, float | None, float]]]) -> None:
    print(
        "\nRay overhead per phase: wall time in the driver, compute inside the workers (slowest worker "
        "per call), overhead = wall - compute; median of the steps after the first; seconds"
    )
    print("| model, layout | phase | wall s | compute s | overhead s | overhead % |")
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
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": actor_env()})
    results, overheads, memory = {}, {}, {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            models: list[tuple[str, str | None, int]] = [("tiny (0.2M)", None, args.steps)]
            if not args.tiny_only:
                models.append(("qwen2vl-114M", str(build_base_judge(Path(tmp) / "base_model")), args.base_steps))
            for model, path, steps in models:
                for layout in layouts:
                    name = f"{model}, {layout}"
                    rows, memory[name] = run(path, steps, args.ranks, args.prompts, Path(tmp) / name, layout)
                    results[name], overheads[name] = summarize(rows), overhead_rows(rows)
    finally:
        ray.shutdown()

    print(
        f"\nGRPO step on CPU: {args.prompts} prompts x 4 samples, <=32 new tokens, {args.ranks} learner "
        f"rank(s), by layout; median of the steps after the first (tiny: {args.steps}{'' if args.tiny_only else f', 114M: {args.base_steps}'} steps); seconds"
    )
    cols = [*PHASES, "untimed", "step"]
    print(
        "| model, layout | "
        + " | ".join(cols)
        + " | resp tokens | tokens/s (step) | tokens/s (gen) | learner padding |"
    )
    print("|---" * (len(cols) + 5) + "|")
    for name, r in results.items():
        cells = " | ".join(f"{r[c]:.3f}" for c in cols)
        print(
            f"| {name} | {cells} | {r['tokens']:.0f} | {r['tok_s']:.1f} | {r['gen_tok_s']:.1f} | {100 * r['padding']:.1f}% |"
        )
    print_overhead(overheads)
    print("\nPeak resident memory per process (ru_maxrss), MiB:")
    print("| model, layout | learner rank | rollout worker | both |")
    print("|---|---|---|---|")
    for name, mem in memory.items():
        rollout = f"{mem['rollout']:.0f}" if "rollout" in mem else "- (none)"
        print(f"| {name} | {mem['learner']:.0f} | {rollout} | {sum(mem.values()):.0f} |")


if __name__ == "__main__":
    main()
