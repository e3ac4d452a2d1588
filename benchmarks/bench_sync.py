"""Weight sync learner -> rollout on one node, against a plain memory copy.

One sender actor (standing in for learner rank 0) loads the judge and plans 64 MB buckets; one
`RolloutWorker` (the HF engine) receives them and copies them into its parameters, through
the trainer's own code for each transport (`trainer.sync_backend`):

- `pickle` / `zero-copy` (object_store): the sender packs each bucket into a fresh buffer and
  `ray.put`s it; the worker fetches one at a time with `ray.get`. Ray's default serialisation
  (torch's pickle, which copies the bytes on put and again on get) against
  `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1` (an out-of-band buffer mapped read-only on get; the
  trainer sets it for its actors).
- `shm`: the sender packs each bucket in place into its shared-memory buffer
  (`pjray.sync.shared.SharedBuckets`), the worker copies from its mapping of the same file
  (`RolloutWorker.load_shared`): one copy in, one copy out.

Each configuration syncs once untimed (buffers and mappings are made; the trainer pays that
once per run), then `--reps` times (the median is shown), and is checked with checksums.

The baseline is one `copy_` of the same number of bytes in one process, one thread (the
actors run with one intra-op thread too): the floor for any transfer on this machine.

Models (`--models`): the tiny test judge (~0.2M parameters) and random Qwen2-VLs built from a
config (no download) with the tiny judge's 2-layer vision tower: `14M` (text hidden 384, 6
layers), `114M` (768, 12) and `400M` (1024, 24; ~1.5 GB of fp32, several GB of RAM in all).

    python benchmarks/bench_sync.py [--bucket-mb 64] [--reps 3] [--models tiny,14M,114M,400M]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from pjray.config import ModelConfig, RolloutConfig
from pjray.models.loading import load_judge
from pjray.models.tiny import build_base_judge, build_tiny_judge
from pjray.rollout.worker import RolloutWorker
from pjray.sync.buckets import pack, plan_buckets, state_checksums
from pjray.sync.shared import SharedBuckets

# name -> (hidden, layers, heads) of `build_base_judge`; "tiny" is the test judge.
SIZES = {"14M": (384, 6, 6), "114M": (768, 12, 12), "400M": (1024, 24, 16)}


class Sender:
    """Holds a judge like learner rank 0 and publishes its parameters as bucket refs."""

    def __init__(self, model_path: str) -> None:
        self.model, _ = load_judge(model_path, trainable=False)
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.01)  # differ from the receiver, as after an optimizer step

        self.shared: SharedBuckets | None = None

    def _planned(self, bucket_bytes: int) -> tuple[dict, list]:
        params = dict(self.model.named_parameters())
        return params, plan_buckets([(n, p.shape, p.dtype) for n, p in params.items()], bucket_bytes)

    def publish(self, bucket_bytes: int) -> tuple[list, list, float]:
        """(plan, refs, seconds spent packing and putting)."""
        start = time.perf_counter()
        params, plan = self._planned(bucket_bytes)
        refs = []
        for bucket in plan:
            flat = pack(bucket, params)
            refs.append(ray.put(flat))
            del flat  # the object store holds the bytes now
        return plan, refs, time.perf_counter() - start

    def publish_shared(self, bucket_bytes: int) -> tuple[list, list, float]:
        """(plan, shared-memory paths, seconds spent packing in place)."""
        start = time.perf_counter()
        params, plan = self._planned(bucket_bytes)
        self.shared = self.shared or SharedBuckets()
        plan, paths = self.shared.write((b, params) for b in plan)
        return plan, paths, time.perf_counter() - start

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()

    def checksums(self) -> dict[str, str]:
        return state_checksums(self.model.named_parameters())


def memcpy_seconds(nbytes: int, reps: int) -> float:
    """Best-of-`reps` time of one single-threaded copy_ of `nbytes` bytes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)


def bench_one(model_path: str, transport: str, bucket_bytes: int, reps: int) -> dict:
    env = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"} if transport == "zero-copy" else {}
    options = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
    sender = ray.remote(**options)(Sender).remote(model_path)
    receiver = ray.remote(**options)(RolloutWorker).remote(model_path, ModelConfig(), RolloutConfig(), 0)
    ray.get(receiver.ready.remote())
    sent = ray.get(sender.checksums.remote())
    publish, load = (
        (sender.publish_shared, receiver.load_shared) if transport == "shm" else (sender.publish, receiver.load_weights)
    )
    put_s, get_s, total_s = [], [], []
    for rep in range(reps + 1):  # rep 0: untimed
        start = time.perf_counter()
        plan, refs, seconds = ray.get(publish.remote(bucket_bytes))
        published = time.perf_counter()
        ray.get(load.remote(plan, refs))
        done = time.perf_counter()
        if rep:
            put_s.append(seconds)
            get_s.append(done - published)
            total_s.append(done - start)
        del refs  # free the buckets before the next round
    if ray.get(receiver.checksums.remote()) != sent:
        raise RuntimeError(f"{model_path} ({transport}): receiver checksums differ after sync")
    ray.get(sender.close.remote())
    ray.kill(sender)
    ray.kill(receiver)
    return {
        "params": sum(b.numel for b in plan),
        "bytes": sum(b.nbytes for b in plan),
        "buckets": len(plan),
        "put": statistics.median(put_s),
        "get": statistics.median(get_s),
        "total": statistics.median(total_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="tiny,114M", help=f"comma list of tiny,{','.join(SIZES)}")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n != "tiny" and n not in SIZES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from tiny,{','.join(SIZES)}")

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in names:
            if name == "tiny":
                models[name] = build_tiny_judge(Path(tmp) / name, seed=0)
            else:
                hidden, layers, heads = SIZES[name]
                models[f"qwen2vl-{name}"] = build_base_judge(
                    Path(tmp) / name, hidden=hidden, layers=layers, heads=heads
                )
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        rows = []
        try:
            for name, path in models.items():
                for transport in ("pickle", "zero-copy", "shm"):
                    result = bench_one(str(path), transport, args.bucket_mb * 2**20, args.reps)
                    result["memcpy"] = memcpy_seconds(result["bytes"], args.reps)
                    rows.append((name, transport, result))
        finally:
            ray.shutdown()

    print(f"\nweight sync, {args.bucket_mb} MB buckets, fp32, median of {args.reps}; memcpy = best single-thread copy_")
    print("(for shm, pack+put is the in-place pack into shared memory and get+copy the copy out of it)")
    header = (
        f"| {'model':<13} | {'transport':<9} | {'params':>8} | {'MB':>7} | {'buckets':>7} | {'pack+put s':>10} "
        f"| {'get+copy s':>10} | {'sync s':>7} | {'sync GB/s':>9} | {'memcpy s':>8} | {'memcpy GB/s':>11} | {'ratio':>6} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    for name, transport, r in rows:
        gb = r["bytes"] / 1e9
        print(
            f"| {name:<13} | {transport:<9} | {r['params'] / 1e6:>7.2f}M | {r['bytes'] / 2**20:>7.1f} "
            f"| {r['buckets']:>7} | {r['put']:>10.4f} | {r['get']:>10.4f} | {r['total']:>7.4f} "
            f"| {gb / r['total']:>9.3f} | {r['memcpy']:>8.5f} | {gb / r['memcpy']:>11.2f} "
            f"| {r['total'] / r['memcpy']:>5.1f}x |"
        )


if __name__ == "__main__":
    main()
