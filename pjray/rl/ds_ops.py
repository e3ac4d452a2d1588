"""DeepSpeed's JIT-built ops on a learner rank: one build directory per Python environment, and no
wait on a lock that a killed build left behind.

DeepSpeed builds its CPU shared-memory collective (`deepspeed_shm_comm`) with
`torch.utils.cpp_extension` the first time a process creates its communication backend. torch
guards a build with a `lock` file in the build directory and waits, without a limit, for any
such file to go away; a build killed mid-way (Ctrl-C, a cancelled job, an OOM kill) leaves it,
and every later learner start-up waits forever. Environments that share the default directory
(`~/.cache/torch_extensions/py311_cpu`) also rebuild over one another's objects.

`prepare_ops` runs before `deepspeed.init_distributed`:
- the build directory is `<pjray cache>/torch_extensions/<environment key>` unless the user set
  `TORCH_EXTENSIONS_DIR`;
- the op is built (or found built) while the rank holds an OS lock (`flock`) on that directory,
  which the kernel releases when its holder dies. pjray's ranks build only while holding it, so a
  torch `lock` found under it in pjray's own directory was left by a build that is gone: it is
  removed with a one-line warning. In a directory the user chose, where other programs may
  build, a lock is removed only when it is also older than `STALE_AFTER_S`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pjray.cache import cache_root

SHM_BUILDER = "ShareMemCommBuilder"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton, one per extension build directory
GUARD = ".pjray-build.flock"
STALE_AFTER_S = 15 * 60  # a build of the op takes about a minute on 2 cores


def environment_key() -> str:
    """Tells apart the environments whose builds must not mix: interpreter, torch, DeepSpeed, CPU,
    and the ninja that builds (the first on PATH). Two ninja releases read each other's build log
    as changed commands and rebuild the op, a minute each time they alternate: a venv's ninja
    (pip's `ninja`, first on PATH under `ray job submit` or with the venv activated) and the
    system's (the venv's python run without activating it)."""
    from deepspeed import __version__ as ds_version

    ninja = shutil.which("ninja") or "no ninja"
    parts = (sys.prefix, sys.version, torch.__version__, ds_version, platform.machine(), ninja)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def extensions_dir() -> tuple[Path, bool]:
    """(the build directory, whether pjray owns it): `TORCH_EXTENSIONS_DIR` if set, else pjray's."""
    ours = cache_root() / "torch_extensions" / environment_key()
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen and Path(chosen) != ours:
        return Path(chosen), False
    return ours, True


@contextmanager
def held(path: Path) -> Iterator[None]:
    """An exclusive `flock` on `path`, released on exit or by the kernel when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_stale_locks(root: Path, owned: bool, log: Callable[[str], None], now: float | None = None) -> list[Path]:
    """Removes the torch build locks under `root` that no live build holds (call with the guard
    held); returns them."""
    now = time.time() if now is None else now
    removed = []
    for lock in sorted(root.glob(f"*/{TORCH_LOCK}")):
        age = now - lock.stat().st_mtime
        if not owned and age < STALE_AFTER_S:
            continue  # another program may be building in a directory the user chose
        log(f"pjray: removing a stale DeepSpeed build lock {lock} ({age:.0f}s old; the build that left it is gone)")
        lock.unlink(missing_ok=True)
        removed.append(lock)
    return removed


def prepare_ops(log: Callable[[str], None] = print) -> None:
    """Points the JIT builds at this environment's directory and builds DeepSpeed's shared-memory
    op there (a no-op load once built), clearing stale locks first. Call before
    `deepspeed.init_distributed`, with DS_ACCELERATOR set."""
    root, owned = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # not an op this accelerator builds
    with held(root / GUARD):
        clear_stale_locks(root, owned, log)
        builder.load(verbose=False)
