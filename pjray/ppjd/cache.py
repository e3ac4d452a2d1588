"""Finished PPJD shards kept once per machine for training's scene data.

A `pjray train` whose scene-data settings and pjray code equal an earlier run's starts from that
run's shards instead of running the Ray Data job again: a sweep's trials, a study's variants,
every new run directory of the same recipe. The key is the job's fingerprint (`job_fingerprint`:
every setting that decides which rows land in which shard and what they hold) with a hash of
pjray's source files, so a code change builds anew. An entry is written whole (a temporary
directory renamed into place) from a finished job's output. Restoring copies its shard files
into a new output directory: `run_ppjd` then finds every shard written, runs no job, and writes
that directory's job file, manifest and card itself. Only the driver reads and writes entries,
so on a multi-node cluster they stay on the driver's node.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pjray.cache import cache_root, code_hash
from pjray.config import PPJDConfig
from pjray.ppjd.pipeline import job_fingerprint

# What the job writes per shard (the rest is per directory). A shard counts as written once its
# `ppjd` parquet exists, so that one is restored last.
SHARD_DIRS = ("stats", "rejects", "ppjd")
COMPLETE = "COMPLETE"


def entry_dir(cfg: PPJDConfig) -> Path:
    """Where the shards of `cfg`'s job are kept on this machine."""
    key = json.dumps({"job": job_fingerprint(cfg), "code": code_hash()}, sort_keys=True)
    return cache_root() / "ppjd" / hashlib.sha256(key.encode()).hexdigest()[:16]


def has_shards(out: Path) -> bool:
    return any((out / "ppjd").glob("*.parquet"))


def restore(cfg: PPJDConfig, out: Path) -> Path | None:
    """Copies the kept shards of `cfg`'s job into `out`, unless none are kept or a job has
    started in `out` (a rerun or resume finishes its own, and `run_ppjd` refuses a directory of
    another config before anything is copied into it); returns the entry it copied from."""
    entry = entry_dir(cfg)
    if not (entry / COMPLETE).exists() or (out / "job.json").exists() or has_shards(out):
        return None
    for name in SHARD_DIRS:
        files = sorted((entry / name).glob("*"))
        if files:
            (out / name).mkdir(parents=True, exist_ok=True)
        for src in files:
            part = out / name / f".{src.name}.part"  # a copy cut short never looks like a shard
            shutil.copyfile(src, part)
            part.replace(out / name / src.name)
    return entry


def store(cfg: PPJDConfig, out: Path, manifest: dict[str, Any]) -> Path | None:
    """Keeps the shards of the finished job in `out` (every shard written); returns the entry,
    or None when the job is unfinished or an entry is already kept."""
    entry = entry_dir(cfg)
    shards = manifest["shards"]
    if (entry / COMPLETE).exists() or shards["complete"] != shards["total"]:
        return None
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in SHARD_DIRS:
        if (out / name).is_dir():
            shutil.copytree(out / name, tmp / name)
    (tmp / COMPLETE).touch()
    try:
        tmp.rename(entry)
    except OSError:  # another run kept the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return entry
