"""Learner step time against DeepSpeed ZeRO stage (0, 1, 2, 3) on CPU.

For each stage, `--ranks` `LearnerRank`s (default 2) start as Ray actors (one CPU each, gloo,
one intra-op thread each: the trainer's CPU layout) from the same judge, and every rank is
given the same shard of experiences at every stage: scene prompts from `scene_items`, rendered
with `render_batch` + the judge's chat template (image included), each followed by a fixed
random response of `--resp-len` byte tokens, a random +-1 advantage, and fixed old/ref
log-probs (so the clipped ratio, the KL term and the reference model are all in play, as in
training with `algo.kl_coef > 0`). Each rank's shard is cut into `--accum` micro-batches.

`train_step` (one optimizer step: forward, backward and DeepSpeed's gradient reduction or
partitioned step per micro-batch) is called `--warmup` times untimed, then `--steps` times;
the table gives the median driver wall time of the timed calls (all ranks finish before the
call returns), its ratio to stage 0, and each rank's peak RSS (`ru_maxrss` of the actor
process: model, reference, optimizer state, activations and DeepSpeed buffers together).

Models: the tiny test judge (~0.2M parameters) and a ~14M-parameter random Qwen2-VL
("mid": text hidden 384, 6 layers, 6 heads, the tiny judge's 2-layer vision tower, tokenizer
and processor; built from a config, no download). The ~114M judge of `bench_step.py` takes
over a minute per step on 2 cores, too slow for four stages.

    python benchmarks/bench_learner.py [--ranks 2] [--prompts 8] [--accum 2] [--resp-len 32]
        [--warmup 1] [--steps 3] [--stages 0,1,2,3] [--tiny-only]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import ray

from pjray.cluster import actor_env
from pjray.config import AlgoConfig, LearnerConfig, ModelConfig
from pjray.data.prompts import render_batch
from pjray.models.loading import load_processor, render_chat
from pjray.models.tiny import build_base_judge, build_tiny_judge
from pjray.placement import free_address
from pjray.ppjd.perturb import scene_items
from pjray.rl.learner import LearnerRank
from pjray.types import Experience


class TimedRank(LearnerRank):
    """A `LearnerRank` that also reports its process's peak resident memory."""

    def peak_rss_mb(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def experiences(model_path: Path, count: int, resp_len: int, seed: int = 0) -> tuple[list[Experience], int]:
    """`count` experiences (scene prompt + fixed random response) and the mean prompt length in tokens."""
    processor = load_processor(model_path)
    rng = random.Random(seed)
    out, prompt_tokens = [], []
    for item in scene_items(count, seed=seed):
        prompt = render_batch(item, rng)
        text = render_chat(processor, prompt)
        response = tuple(rng.randrange(256) for _ in range(resp_len))  # byte tokens, no specials
        out.append(
            Experience(
                prompt_text=text,
                image=prompt.image,
                response_ids=response,
                advantage=rng.choice((-1.0, 1.0)),
                old_logprobs=tuple(-6.0 - 0.1 * rng.random() for _ in range(resp_len)),
                ref_logprobs=tuple(-6.0 - 0.1 * rng.random() for _ in range(resp_len)),
            )
        )
        enc = processor(text=[text], images=None if prompt.image is None else [_image(prompt.image)])
        prompt_tokens.append(len(enc["input_ids"][0]))
    return out, round(statistics.mean(prompt_tokens))


def _image(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def bench_stage(model_path: Path, stage: int, shard: list[Experience], args: argparse.Namespace) -> dict[str, float]:
    micro = len(shard) // args.accum
    learner_cfg = LearnerConfig(num_ranks=args.ranks, zero_stage=stage, micro_batch_size=micro, lr=1e-6)
    port = free_address()[1]
    ranks = [
        ray.remote(num_cpus=1)(TimedRank).remote(
            ModelConfig(),
            learner_cfg,
            AlgoConfig(),
            str(model_path),
            rank=r,
            world_size=args.ranks,
            master_addr="127.0.0.1",
            master_port=port,
            total_steps=args.warmup + args.steps,
            grad_accum_steps=args.accum,
        )
        for r in range(args.ranks)
    ]
    try:
        ray.get([r.ready.remote() for r in ranks])
        tokens = float(sum(len(e.response_ids) for e in shard) * args.ranks)
        seqs = float(len(shard) * args.ranks)
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            metrics = ray.get([r.train_step.remote(shard, tokens, seqs) for r in ranks])
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        rss = ray.get([r.peak_rss_mb.remote() for r in ranks])
        ray.get([r.shutdown.remote() for r in ranks])
    finally:
        for r in ranks:
            ray.kill(r)
    return {"step": statistics.median(times), "all": times, "rss": rss, "loss": metrics[0]["actor/pg_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per rank per step")
    parser.add_argument("--resp-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--tiny-only", action="store_true")
    args = parser.parse_args()
    if args.prompts % args.accum:
        parser.error("--prompts must be a multiple of --accum")
    stages = [int(s) for s in args.stages.split(",")]

    results: list[tuple[str, int, int, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny (0.2M)": build_tiny_judge(Path(tmp) / "tiny", seed=0)}
        if not args.tiny_only:
            models["qwen2vl-mid (14M)"] = build_base_judge(Path(tmp) / "mid", hidden=384, layers=6, heads=6)  # ~14.7M
        ray.init(
            num_cpus=args.ranks, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": actor_env()}
        )
        try:
            for name, path in models.items():
                shard, prompt_len = experiences(path, args.prompts, args.resp_len)
                for stage in stages:
                    r = bench_stage(path, stage, shard, args)
                    print(f"{name} ZeRO-{stage}: {', '.join(f'{t:.3f}' for t in r['all'])} s", flush=True)
                    results.append((name, stage, prompt_len, r))
        finally:
            ray.shutdown()

    print(
        f"\nlearner train_step on CPU: {args.ranks} ranks (gloo, 1 thread each), {args.prompts} sequences per rank "
        f"in {args.accum} micro-batches, {args.resp_len} response tokens each, KL on; median of {args.steps} "
        f"after {args.warmup} warm-up"
    )
    print("| model | prompt tokens | ZeRO stage | s/step | vs stage 0 | peak RSS per rank (MB) |")
    print("|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for name, stage, prompt_len, r in results:
        if stage == 0:
            base[name] = r["step"]
        ratio = f"{r['step'] / base[name]:.2f}x" if name in base else "-"
        rss = " / ".join(f"{m:.0f}" for m in r["rss"])
        print(f"| {name} | {prompt_len} | {stage} | {r['step']:.3f} | {ratio} | {rss} |")


if __name__ == "__main__":
    main()
