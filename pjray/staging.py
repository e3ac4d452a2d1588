"""A checkpoint copied to each node's local disk once before the actors load it (`model.stage_dir`).

At start-up every learner rank loads the policy (and the reference), and every rollout engine
loads the weights again: on a node of 8 GPUs that is a dozen readers of one checkpoint on shared
storage at once. With `model.stage_dir` set (a node-local path, e.g. /local_disk/pjray), one task
a node copies the checkpoint there first, and every actor reads the copy. A finished copy is
reused (its name carries a digest of the source's files), so a restarted run or a later trial on
the same node copies nothing.

A hub id is staged too: the driver resolves it to one commit (the hub's, or offline the local
cache's), and each node's task fetches that snapshot into its hub cache (a download, or nothing
when it is cached) and copies its model files (`HUB_FILES`) to `<stage_dir>/<owner>--<name>-<commit>`,
so every node stages the same commit under the same path and the actors never read the shared
cache or the hub.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pjray.inputs import is_hub_id

__all__ = ["HUB_FILES", "hub_revision", "stage_checkpoint", "stage_hub_snapshot", "stage_on_nodes", "staged_name"]

log = logging.getLogger(__name__)
_DONE = ".pjray-staged"
# The files of a hub snapshot that a model needs: config, weights, tokenizer, processor and
# chat template (not the .bin/.pth duplicates, READMEs or images some repos carry).
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


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
    is there; returns the copy's path."""
    source = Path(src)
    return _copy_into_place(source, Path(stage_dir) / staged_name(source))


def stage_hub_snapshot(repo: str, revision: str, stage_dir: str) -> str:
    """The hub snapshot `repo` at commit `revision`, fetched into this node's hub cache (nothing
    to fetch when it is cached) and its `HUB_FILES` copied to
    `<stage_dir>/<owner>--<name>-<revision[:16]>` unless a finished copy is there."""
    import huggingface_hub

    dest = Path(stage_dir) / f"{repo.replace('/', '--')}-{revision[:16]}"
    if (dest / _DONE).exists():
        return str(dest)
    snapshot = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES)))
    if not any(snapshot.rglob("*.safetensors")):
        raise RuntimeError(
            f"model.stage_dir: {repo} at {revision[:12]} has no .safetensors weights to stage; "
            "load it without model.stage_dir"
        )
    return _copy_into_place(snapshot, dest, _not_model_files)


def _not_model_files(folder: str, names: list[str]) -> set[str]:
    """`shutil.copytree`'s `ignore`: the files of `names` that match none of `HUB_FILES`."""
    return {n for n in names if Path(folder, n).is_file() and not any(fnmatch.fnmatch(n, pat) for pat in HUB_FILES)}


def _copy_into_place(source: Path, dest: Path, ignore: Any = None) -> str:
    """Copy `source` (links followed) to `dest` unless a finished copy is there; returns `dest`.
    The copy is made beside it and renamed into place, so a reader never sees half of one and
    two stagers on one node race harmlessly."""
    if (dest / _DONE).exists():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=ignore)
    (tmp / _DONE).write_text(str(source))
    try:
        os.rename(tmp, dest)
    except OSError:  # another stager finished first (or a broken copy is in the way)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / _DONE).exists():
            raise
    return str(dest)


def hub_revision(repo: str) -> str:
    """The commit the hub id `repo` names now: the hub's answer, or, offline (HF_HUB_OFFLINE) or
    when the hub cannot be asked, the commit of the local cache's `main`, as `from_pretrained`
    would load."""
    import huggingface_hub
    from huggingface_hub import constants

    asked = "offline (HF_HUB_OFFLINE)"
    if not constants.HF_HUB_OFFLINE:
        try:
            sha = huggingface_hub.model_info(repo, timeout=10).sha
            if sha:
                return sha
        except Exception as err:  # noqa: BLE001 - unreachable or refused: the cache may still have it
            asked = f"the hub could not be asked ({type(err).__name__})"
    cached = huggingface_hub.try_to_load_from_cache(repo, "config.json")
    if not isinstance(cached, str):
        raise RuntimeError(f"model.stage_dir: {repo}: {asked}, and not in the local hub cache")
    return Path(cached).parent.name


def stage_on_nodes(src: str, stage_dir: str, node_ids: list[str]) -> str:
    """Stage `src` once on each of the distinct Ray nodes `node_ids` (a task pinned to each, side
    by side): a directory by `stage_checkpoint`, a hub id by `stage_hub_snapshot` at the one
    commit `hub_revision` resolves here. Returns the staged path, the same on every node; without
    a `stage_dir`, `src` itself."""
    if not stage_dir:
        return src
    if Path(src).is_dir():
        stage, args = ray.remote(num_cpus=0)(stage_checkpoint), (src, stage_dir)
    elif is_hub_id(src):
        revision = hub_revision(src)
        log.info("model.stage_dir: %s resolved to commit %s", src, revision)
        stage, args = ray.remote(num_cpus=0)(stage_hub_snapshot), (src, revision, stage_dir)
    else:
        raise RuntimeError(f"model.stage_dir: {src} is neither a directory nor a hub id")
    calls = [
        stage.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
        for node in sorted(set(node_ids))
    ]
    paths = set(ray.get(calls))
    if len(paths) != 1:
        raise RuntimeError(f"model.stage_dir: the nodes staged {src} to different paths {sorted(paths)}")
    return paths.pop()
