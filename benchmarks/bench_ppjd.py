"""PPJD job throughput on the synthetic source (rules + oracle), with 1 and 2 worker CPUs.

    python benchmarks/bench_ppjd.py [--items 512] [--shard-size 32] [--candidates 3] [--image-size 128]

Each setting runs on a fresh local Ray cluster of that many CPUs (after a small warm-up run, so
worker start-up is not charged to the first setting) into a fresh output directory. Per-stage
rows/s is per worker (rows / seconds of work in that stage); end to end is rows / wall time of
`run_ppjd`, including reading the source and Ray Data scheduling. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import ray

from pjray.config import PPJDConfig
from pjray.ppjd.pipeline import run_ppjd

STAGES = ("load", "verify", "extract", "perturb", "check", "vqa", "decontam", "write")


def run(num_cpus: int, items: int, shard_size: int, candidates: int, image_size: int, out: Path) -> dict:
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    try:
        warm = PPJDConfig(num_items=2 * shard_size, shard_size=shard_size, output_dir=str(out / "warm"))
        run_ppjd(warm)
        cfg = PPJDConfig(
            num_items=items,
            shard_size=shard_size,
            num_candidates=candidates,
            image_size=image_size,
            output_dir=str(out / f"cpus{num_cpus}"),
        )
        return run_ppjd(cfg)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument(
        "--image-size", type=int, default=128, help="scene side in pixels (more rendering work per row)"
    )
    args = parser.parse_args()
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            n: run(n, args.items, args.shard_size, args.candidates, args.image_size, Path(tmp) / f"n{n}")
            for n in (1, 2)
        }
    print(
        f"\nPPJD scenes, rules + oracle: {args.items} rows of {args.image_size}px, K={args.candidates}, "
        f"shards of {args.shard_size}\n"
    )
    print("| stage | rows/s/worker (1 CPU) | rows/s/worker (2 CPUs) |")
    print("|---|---:|---:|")
    for stage in STAGES:
        cells = [results[n]["stages"].get(stage, {}).get("rows_per_s_per_worker") for n in (1, 2)]
        print(f"| {stage} | " + " | ".join(f"{c:,.0f}" if c else "-" for c in cells) + " |")
    e2e = {n: results[n]["rows_per_s"] for n in (1, 2)}
    print(f"| **end to end** | {e2e[1]:,.1f} | {e2e[2]:,.1f} |")
    print(
        f"\nscaling 2 CPUs / 1 CPU: {e2e[2] / e2e[1]:.2f}x  "
        f"(kept {results[2]['counts']['kept']}/{results[2]['counts']['read']}; "
        f"wall {results[1]['wall_seconds']:.1f} s vs {results[2]['wall_seconds']:.1f} s)"
    )


if __name__ == "__main__":
    main()
