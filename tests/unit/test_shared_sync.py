"""The same-node weight transport: shared-memory buffers written in place by the learner and
mapped by the engines (`pjray.sync.shared.SharedBuckets` / `SharedBucketReader`), and what
trainer.sync_backend=auto picks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pjray.config import RolloutConfig
from pjray.sync.buckets import pack, plan_buckets, state_checksums, unpack
from pjray.sync.shared import SharedBucketReader, SharedBuckets, remove_stale_buffers
from pjray.sync.transports import auto_transport


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (50, 8), "layer.w": (8, 8), "layer.b": (8,), "head": (8, 50)}
    weights = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    weights["half"] = torch.randn(6, generator=g).to(torch.bfloat16)  # a second dtype, a second bucket
    return weights


def _buckets(weights: dict[str, torch.Tensor], bucket_bytes: int = 1024):
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in weights.items()], bucket_bytes)
    return [(b, {e.name: weights[e.name] for e in b.entries}) for b in plan]


def _received(plan, views) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan, views):
        out.update({k: v.clone() for k, v in unpack(bucket, flat).items()})
    return out


def test_a_sync_through_shared_memory_is_exact_and_reuses_its_buffers(tmp_path):
    writer, reader = SharedBuckets(tmp_path), SharedBucketReader()
    first = _weights(0)
    plan, paths = writer.write(_buckets(first))
    assert len(plan) >= 3 and len(paths) == len(plan) and all(os.path.isfile(p) for p in paths)
    views = reader.views(plan, paths)
    assert state_checksums(_received(plan, views)) == state_checksums(first)

    # The next sync rewrites the same buffers in place: the engine's mapping sees the new weights.
    second = _weights(1)
    plan2, paths2 = writer.write(_buckets(second))
    assert paths2 == paths and plan2 == plan
    assert state_checksums(_received(plan, views)) == state_checksums(second)
    assert all(a is b for a, b in zip(reader.views(plan, paths), views))  # mapped once

    writer.close()
    assert not any(os.path.exists(p) for p in paths)


def test_a_new_plan_gets_new_buffers_and_drops_the_unused(tmp_path):
    writer = SharedBuckets(tmp_path)
    weights = _weights(0)
    _, paths = writer.write(_buckets(weights, 1024))
    plan, fewer = writer.write(_buckets(weights, 1 << 20))  # one bucket per dtype now
    assert len(fewer) == 2 < len(paths)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in fewer)
    assert state_checksums(_received(plan, SharedBucketReader().views(plan, fewer))) == state_checksums(weights)
    writer.close()


def test_buffers_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / f"pjray-sync-{dead.stdout.strip()}-abcd1234-0"
    stale.write_bytes(b"\0" * 8)
    writer = SharedBuckets(tmp_path)  # sweeps on creation
    assert not stale.exists()
    _, paths = writer.write(_buckets(_weights(0)))
    assert remove_stale_buffers(tmp_path) == [] and all(os.path.isfile(p) for p in paths)
    writer.close()


def test_a_buffer_too_large_for_the_shared_directory_goes_to_the_temporary_one(tmp_path, monkeypatch):
    import pjray.sync.shared as sync

    small, temp = tmp_path / "shm", tmp_path / "tmp"
    small.mkdir()
    temp.mkdir()
    monkeypatch.setattr(sync.tempfile, "gettempdir", lambda: str(temp))
    monkeypatch.setattr(sync, "free_bytes", lambda d: 0 if d == small else 1 << 40)  # a full tmpfs
    writer = SharedBuckets(small)
    weights = _weights(0)
    plan, paths = writer.write(_buckets(weights))
    assert all(os.path.dirname(p) == str(temp) for p in paths) and not os.listdir(small)
    assert state_checksums(_received(plan, SharedBucketReader().views(plan, paths))) == state_checksums(weights)
    writer.close()
    assert not os.listdir(temp)


def test_a_buffer_from_another_node_is_a_clear_error(tmp_path):
    plan = [b for b, _ in _buckets(_weights(0))]
    with pytest.raises(FileNotFoundError, match="not on this node"):
        SharedBucketReader().views(plan, [str(tmp_path / f"missing-{i}") for i in range(len(plan))])
    with pytest.raises(ValueError, match="buckets in the plan"):
        SharedBucketReader().views(plan, [])


def test_pack_into_a_given_buffer_checks_it():
    weights = _weights(0)
    bucket, tensors = _buckets(weights)[0]
    out = torch.empty(bucket.numel, dtype=bucket.dtype)
    assert pack(bucket, tensors, out=out) is out
    assert torch.equal(out, pack(bucket, tensors))
    with pytest.raises(ValueError, match="out is"):
        pack(bucket, tensors, out=torch.empty(bucket.numel + 1, dtype=bucket.dtype))


def test_auto_transport_per_layout():
    hf, vllm_cpu = RolloutConfig(backend="hf"), RolloutConfig(backend="vllm", device="cpu")
    vllm_gpu = RolloutConfig(backend="vllm", num_gpus_per_worker=1)
    colocated = RolloutConfig(backend="vllm", num_gpus_per_worker=0.4, colocate=True)
    # Same node: shared memory, for either engine on CPU.
    assert auto_transport(hf, False, "n0", ["n0", "n0"]) == "shm"
    assert auto_transport(vllm_cpu, False, "n0", ["n0"]) == "shm"
    # Another node (or nothing to ask): the object store.
    assert auto_transport(hf, False, "n0", ["n0", "n1"]) == "object_store"
    assert auto_transport(vllm_cpu, False, "n0", ["n1"]) == "object_store"
    assert auto_transport(hf, False, "n0", []) == "object_store"
    # vLLM on GPUs: NCCL on any node pair, CUDA IPC when colocated.
    assert auto_transport(vllm_gpu, True, "n0", ["n0"]) == "nccl"
    assert auto_transport(vllm_gpu, True, "n0", ["n1"]) == "nccl"
    assert auto_transport(colocated, True, "n0", ["n0"]) == "ipc"
    # A CPU learner cannot join NCCL: vLLM's GPU engines then take the node rule.
    assert auto_transport(vllm_gpu, False, "n0", ["n0"]) == "shm"
