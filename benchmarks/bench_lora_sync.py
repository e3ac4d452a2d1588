"""LoRA weight sync: the adapter alone (model.lora.sync=adapter) against the merged full weights.

One `LearnerRank` (DeepSpeed, one rank, gloo) trains rank-`--rank` LoRA adapters on every linear
layer of the language model (PEFT's all-linear, none in the vision tower) of a random Qwen2-VL
judge built from a config (`--size`: 114M parameters by default; no download), and takes one
GRPO step so the adapters are not zero. Then, on the same judge and learner, each path syncs to a
fresh `RolloutWorker` (the HF engine) through the trainer's own transport classes:

- `adapter`: `AdapterTransport`: the learner exports the adapter (PEFT's state dict and config),
  puts it in the object store once; the worker wraps its model in PEFT (first sync) and copies
  the adapter in.
- `merged object_store`: `ObjectStoreTransport`: the learner computes every adapted weight
  merged (W + scaling * B @ A), packs 64 MB buckets and puts them; the worker copies them in.
- `merged shm`: `SharedMemoryTransport`: the same merged buckets through shared memory (what
  trainer.sync_backend=auto picks for workers on the learner's node).

Each path syncs once untimed, then `--reps` times (median shown). After its syncs the worker
samples `--prompts` x 2 responses and the learner recomputes their log-probs (teacher-forced,
the rollout's temperature): the largest |engine - learner| gap shows the worker serves the
learner's policy. Bytes are what one sync moves (the adapter's tensors; the merged buckets).

Last line, JSON: {"bytes_ratio": adapter bytes / merged bytes, "time_ratio": adapter seconds /
the faster merged path's, "logprob_max_abs_diff": the adapter path's gap}.

    python benchmarks/bench_lora_sync.py [--size 114M] [--rank 8] [--reps 3] [--quick]

`--quick` (one timed sync per path, 4 new tokens) runs in about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from pjray.cluster import actor_env
from pjray.config import AlgoConfig, LearnerConfig, LoraConfig, ModelConfig, RolloutConfig
from pjray.models.loading import load_processor, render_chat
from pjray.models.tiny import build_base_judge
from pjray.placement import RankGroup, free_address
from pjray.rl.learner import LearnerRank
from pjray.rollout.worker import RolloutWorker
from pjray.sync.transports import AdapterTransport, ObjectStoreTransport, SharedMemoryTransport, Transport
from pjray.types import Experience, JudgePrompt

# name -> (hidden, layers, heads) of `build_base_judge`, as benchmarks/bench_sync.py builds them.
SIZES = {"14M": (384, 6, 6), "114M": (768, 12, 12), "400M": (1024, 24, 16)}
BUCKET_BYTES = 64 << 20


def _prompts(count: int) -> list[JudgePrompt]:
    return [
        JudgePrompt(
            item_id=f"p{i}",
            system="You are a careful judge.",
            user=f"Rank the answers. A: {i} red B: {i} blue C: green",
            image=None,
            protocol="batch",
            style="ranking",
            num_candidates=3,
            shown=(0, 1, 2),
            target="ABC",
        )
        for i in range(count)
    ]


def _experiences(processor, prompts: list[JudgePrompt], completions) -> list[Experience]:
    return [
        Experience(
            prompt_text=render_chat(processor, prompts[c.prompt_index]),
            image=None,
            response_ids=c.token_ids,
            advantage=1.0 if c.sample_index % 2 else -1.0,
        )
        for c in completions
    ]


def bench_path(
    name: str,
    transport: Transport,
    learner,
    model_path: str,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    prompts: list[JudgePrompt],
    processor,
    reps: int,
) -> dict[str, float]:
    """Sync `reps` + 1 times through `transport` to a fresh worker (the first untimed), then measure
    its log-prob gap to the learner on fresh samples."""
    worker = ray.remote(num_cpus=1)(RolloutWorker).remote(model_path, model_cfg, rollout_cfg, 0, 1)
    pool = RankGroup([worker])
    try:
        ray.get(worker.ready.remote())
        transport.connect([learner], pool)
        seconds = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            transport.send([learner], pool)
            if rep:
                seconds.append(time.perf_counter() - start)
        plan = ray.get(learner.weight_plan.remote(BUCKET_BYTES))
        sent = transport.sent_bytes if isinstance(transport, AdapterTransport) else sum(b.nbytes for b in plan)
        completions = ray.get(worker.generate.remote(prompts, 2, 7))
        learner_logprobs = ray.get(learner.compute_logprobs.remote(_experiences(processor, prompts, completions)))
        gap = max(abs(a - b) for c, lp in zip(completions, learner_logprobs) for a, b in zip(c.logprobs, lp))
    finally:
        transport.close([learner])
        ray.kill(worker)
    return {
        "path": name,
        "bytes": sent,
        "seconds": statistics.median(seconds),
        "gap": gap,
        "params": sum(b.numel for b in plan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="114M", choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one timed sync per path, 4 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.max_new = 1, 4

    model_cfg = ModelConfig(lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    rollout_cfg = RolloutConfig(backend="hf", max_new_tokens=args.max_new, temperature=1.0)
    prompts = _prompts(args.prompts)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": actor_env()})
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hidden, layers, heads = SIZES[args.size]
        model_path = str(build_base_judge(Path(tmp) / args.size, hidden=hidden, layers=layers, heads=heads))
        processor = load_processor(model_path, model_cfg.image_budget)
        learner = ray.remote(num_cpus=1)(LearnerRank).remote(
            model_cfg,
            LearnerConfig(micro_batch_size=2 * args.prompts, lr=1e-2),
            AlgoConfig(kl_coef=0.0),
            model_path,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_address()[1],
            total_steps=1,
            grad_accum_steps=1,
            temperature=rollout_cfg.temperature,
            num_threads=1,
        )
        try:
            # One GRPO step on responses of the base judge, so the adapters are not zero (B = 0 at start).
            sampler = ray.remote(num_cpus=1)(RolloutWorker).remote(model_path, ModelConfig(), rollout_cfg, 0, 1)
            experiences = _experiences(processor, prompts, ray.get(sampler.generate.remote(prompts, 2, 0)))
            ray.kill(sampler)
            tokens = float(sum(len(e.response_ids) for e in experiences))
            ray.get(learner.train_step.remote(experiences, tokens, float(len(experiences))))
            adapter_model = dataclasses.replace(model_cfg, lora=dataclasses.replace(model_cfg.lora, sync="adapter"))
            paths: list[tuple[str, Transport, ModelConfig]] = [
                ("adapter", AdapterTransport(BUCKET_BYTES), adapter_model),
                ("merged object_store", ObjectStoreTransport(BUCKET_BYTES), model_cfg),
                ("merged shm", SharedMemoryTransport(BUCKET_BYTES), model_cfg),
            ]
            for name, transport, cfg in paths:
                rows.append(
                    bench_path(name, transport, learner, model_path, cfg, rollout_cfg, prompts, processor, args.reps)
                )
        finally:
            ray.kill(learner)
            ray.shutdown()

    adapter, merged = rows[0], rows[1:]
    fastest = min(merged, key=lambda r: r["seconds"])
    print(
        f"\nLoRA weight sync, {args.size} Qwen2-VL judge ({merged[0]['params'] / 1e6:.1f}M parameters), rank "
        f"{args.rank}, all-linear, fp32, HF engine; median of {args.reps} syncs after an untimed one"
    )
    header = (
        f"| {'path':<19} | {'MB per sync':>11} | {'bytes vs merged':>15} | {'sync s':>8} | {'logprob max diff':>16} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['path']:<19} | {r['bytes'] / 2**20:>11.2f} | {r['bytes'] / merged[0]['bytes']:>14.2%} "
            f"| {r['seconds']:>8.4f} | {r['gap']:>16.2e} |"
        )
    print(
        json.dumps(
            {
                "bytes_ratio": round(adapter["bytes"] / merged[0]["bytes"], 5),
                "time_ratio": round(adapter["seconds"] / fastest["seconds"], 4),
                "logprob_max_abs_diff": float(f"{adapter['gap']:.3g}"),
            }
        )
    )


if __name__ == "__main__":
    main()
