"""A checkpoint copied to each node's local disk once before the actors load it (`model.stage_dir`).

At start-up every learner rank loads the policy (and the reference), and every rollout engine
loads the weights again: on a node of 8 GPUs that is a dozen readers of one checkpoint on shared
storage at once. With `model.stage_dir` set (a node-local path, e.g. /local_disk/pjray), one task
a node copies the checkpoint there first, and every actor reads the copy. A finished copy is
reused (its name carries a digest of the source's files), so a restarted run or a later trial on
the same node copies nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["stage_checkpoint", "stage_on_nodes", "staged_name"]

log = logging.getLogger(__name__)
_DONE = ".pjray-staged"


def staged_name(src: Path) -> str:
    """`<directory name>-<digest>`: the digest of every file's relative path, size and mtime, so
    a checkpoint rewritten in place is staged anew."""
    digest = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        info = path.stat()
        digest.update(f"{path.relative_to(src)}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return f"{src.name}-{digest.hexdigest()[:16]}"


def stage_checkpoint(src: str, stage_dir: str) -> str:
    """Copy the directory `src` to `<stage_dir>/<staged_name>` on this node unless a finished copy
    is there; returns the copy's path. The copy is made beside it and renamed into place, so a
    reader never sees half of one and two stagers on one node race harmlessly."""
    source = Path(src)
    dest = Path(stage_dir) / staged_name(source)
    if (dest / _DONE).exists():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    (tmp / _DONE).write_text(str(source))
    try:
        os.rename(tmp, dest)
    except OSError:  # another stager finished first (or a broken copy is in the way)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / _DONE).exists():
            raise
    return str(dest)


def stage_on_nodes(src: str, stage_dir: str, node_ids: list[str]) -> str:
    """`stage_checkpoint` once on each of the distinct Ray nodes `node_ids` (a task pinned to
    each, side by side); returns the staged path, the same on every node. Without a
    `stage_dir`, or for a source that is not a directory (a hub id: each node's HF cache
    downloads it once), `src` itself."""
    if not stage_dir:
        return src
    if not Path(src).is_dir():
        log.info("model.stage_dir: %s is not a directory; the actors load it as it is", src)
        return src
    stage = ray.remote(num_cpus=0)(stage_checkpoint)
    calls = [
        stage.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(src, stage_dir)
        for node in sorted(set(node_ids))
    ]
    paths = set(ray.get(calls))
    if len(paths) != 1:
        raise RuntimeError(f"model.stage_dir: the nodes staged {src} to different paths {sorted(paths)}")
    return paths.pop()
