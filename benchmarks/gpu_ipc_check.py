"""The colocated weight sync's CUDA IPC stream, checked on a GPU without vLLM.

A DeepSpeed learner rank (`LearnerRank`, world size 1, on cuda:0) streams its weights through
two reused CUDA buffers (`pjray.sync.ipc.stream_buckets`, the code `WeightSender.stream_ipc`
runs) to a second process, which maps the buffers' IPC handles as the colocated engine does
(`open_ipc_handle` with its own device index), reads each bucket from its slot when told to
(`slot_view`, a copy) and acknowledges it; the learner packs a slot again only after that
acknowledgement. The receiver's checksums must equal the rank's own (`checksums()`), before and
after each optimizer step (a later sync reuses nothing stale). Printed per sync: the sender's
peak GPU memory above its resting level during the stream, against the packed model's size (the
stream holds two buckets, not the model), and its allocated memory after the sync, which must
not grow from sync to sync.

Prints one line per sync with its figures, then PASS, or FAIL and a non-zero exit when a sync's
checksums differ, a sync after a step sees no changed tensor, or the stream's peak exceeds two
of its buffers.
Usage: python benchmarks/gpu_ipc_check.py [--arch qwen2_vl] [--syncs 3] [--bf16]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import random
import sys
import tempfile
import time
from typing import Any

import PIL.Image
import torch

from pjray.config import AlgoConfig, LearnerConfig, ModelConfig
from pjray.models.tiny import build_tiny_judge
from pjray.placement import free_address
from pjray.rl.learner import LearnerRank
from pjray.sync.buckets import Bucket, state_checksums, unpack
from pjray.sync.collective import dumps, loads
from pjray.sync.ipc import open_ipc_handle, slot_view, stream_buckets
from pjray.types import Experience

BUCKET_BYTES = 1 << 16  # several buckets even for a tiny model


def receiver(conn) -> None:  # noqa: ANN001  (a multiprocessing connection)
    """The engine's side: map the slots at "begin", read and hash each bucket at "load" (a copy,
    as `pjray_load_ipc_bucket` takes), acknowledge it, and reply with the checksums at "finish"."""
    torch.cuda.set_device(0)
    device_index = torch.cuda.current_device()
    slots: list[torch.Tensor] = []
    sums: dict[str, str] = {}
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        kind, payload = loads(message)
        if kind == "begin":
            slots, sums, start = [open_ipc_handle(h, device_index) for h in payload], {}, time.perf_counter()
            if any(slot.device.type != "cuda" for slot in slots):
                raise RuntimeError("an IPC slot was mapped off the GPU")
        elif kind == "load":
            bucket, slot = payload
            flat = slot_view(slots[slot], bucket).clone()
            torch.cuda.synchronize()
            conn.send_bytes(b"read")  # the learner may pack this slot again
            sums.update(state_checksums(unpack(bucket, flat)))
        else:
            slots = []
            torch.cuda.synchronize()
            conn.send((sums, time.perf_counter() - start))


class PipeReceiver:
    """The receiving end of `stream_buckets` over a pipe to `receiver` (`IpcReceiver`)."""

    def __init__(self, conn) -> None:  # noqa: ANN001
        self.conn = conn

    def begin(self, handles: list[Any]) -> None:
        self.conn.send_bytes(dumps(("begin", handles)))

    def load(self, bucket: Bucket, slot: int) -> int:
        self.conn.send_bytes(dumps(("load", (bucket, slot))))
        return slot

    def wait(self, pending: int) -> None:
        if self.conn.recv_bytes() != b"read":  # acknowledgements come in the order of the loads
            raise RuntimeError("the receiver answered out of turn")

    def finish(self) -> None:
        self.conn.send_bytes(dumps(("finish", None)))


def experiences(n: int, seed: int) -> list[Experience]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        image = PIL.Image.new("RGB", (56 + 28 * (i % 2), 56), tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Rank A, B and C.<|im_end|>\n<|im_start|>assistant\n"
        response = tuple(rng.randrange(0, 400) for _ in range(rng.randrange(4, 12)))
        out.append(
            Experience(prompt_text=prompt, image=buf.getvalue(), response_ids=response, advantage=rng.uniform(-1, 1))
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2_vl")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_ipc_check: no CUDA GPU visible; nothing to check", file=sys.stderr)
        return 1

    judge = build_tiny_judge(tempfile.mkdtemp(prefix="pjray-ipc-"), arch=args.arch, seed=0)
    dtype = "bfloat16" if args.bf16 else "float32"
    rank = LearnerRank(
        ModelConfig(dtype=dtype),
        LearnerConfig(zero_stage=2, micro_batch_size=4, lr=1e-3, bf16=args.bf16),
        AlgoConfig(kl_coef=0.0),
        str(judge),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=args.syncs,
        grad_accum_steps=1,
    )
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(theirs,), daemon=True)
    proc.start()
    failures = 0
    try:
        batch = experiences(4, seed=0)
        tokens = float(sum(len(e.response_ids) for e in batch))
        previous: dict[str, str] = {}
        baseline = None
        for sync in range(args.syncs):
            expected = rank.checksums()
            plan = rank.weight_plan(BUCKET_BYTES)
            capacity = max(b.nbytes for b in plan)
            torch.cuda.synchronize()
            resting = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            slots = [torch.empty(capacity, dtype=torch.uint8, device="cuda") for _ in range(2)]
            sent = stream_buckets(rank.weights.full_buckets(BUCKET_BYTES), slots, PipeReceiver(ours))
            got, load_s = ours.recv()
            stream_s = time.perf_counter() - start
            del slots
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            peak = torch.cuda.max_memory_allocated() - resting
            allocated = torch.cuda.memory_allocated()
            baseline = allocated if baseline is None else baseline
            nbytes = sum(b.nbytes for b in plan)
            same = got == expected
            changed = sum(previous.get(k) != v for k, v in expected.items()) if previous else len(expected)
            print(
                f"sync {sync}: {sent} buckets, model {nbytes / 2**20:.2f} MiB, slots 2 x {capacity / 2**10:.0f} KiB; "
                f"stream {stream_s * 1e3:.1f} ms (receiver {load_s * 1e3:.1f} ms); sender peak +{peak / 2**20:.2f} MiB "
                f"above rest; {len(got)}/{len(expected)} tensors received, checksums {'EQUAL' if same else 'DIFFER'}; "
                f"{changed} tensors changed since the last sync; sender allocated {allocated / 2**20:.1f} MiB"
            )
            if not same or (previous and changed == 0) or peak > 2 * capacity + (1 << 20):
                failures += 1
            previous = expected
            metrics = rank.train_step(batch, tokens, float(len(batch)))
            print(f"  step {sync}: loss {metrics['actor/pg_loss']:.4f}, grad_norm {metrics['actor/grad_norm']:.4f}")
        grown = torch.cuda.memory_allocated() - baseline
        print(f"sender memory after {args.syncs} syncs vs after the first: {grown / 2**20:+.1f} MiB")
    finally:
        ours.send_bytes(b"")
        proc.join(timeout=30)
        rank.shutdown()
    print("gpu_ipc_check:", "PASS" if failures == 0 else f"FAIL ({failures} sync(s) wrong)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
