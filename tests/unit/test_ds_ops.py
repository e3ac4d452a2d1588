"""Which torch build locks a learner rank removes before DeepSpeed builds its op."""

from __future__ import annotations

import multiprocessing
import os
import time

from pjray.rl.ds_ops import STALE_AFTER_S, TORCH_LOCK, clear_stale_locks, extensions_dir, held


def _locks(root, *names):
    paths = []
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / TORCH_LOCK).touch()
        paths.append(root / name / TORCH_LOCK)
    return paths


def test_in_pjrays_own_directory_every_lock_found_under_the_guard_is_stale(tmp_path):
    fresh, old = _locks(tmp_path, "op_a", "op_b")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    lines: list[str] = []
    assert clear_stale_locks(tmp_path, owned=True, log=lines.append) == [fresh, old]
    assert not fresh.exists() and not old.exists()
    assert len(lines) == 2 and "removing a stale DeepSpeed build lock" in lines[0]


def test_in_a_directory_the_user_chose_only_old_locks_go(tmp_path):
    fresh, old = _locks(tmp_path, "op_a", "op_b")
    now = time.time()
    os.utime(old, (now - STALE_AFTER_S - 1, now - STALE_AFTER_S - 1))
    assert clear_stale_locks(tmp_path, owned=False, log=lambda line: None, now=now) == [old]
    assert fresh.exists() and not old.exists()


def test_the_directory_is_per_environment_unless_the_user_sets_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path))
    ours, owned = extensions_dir()
    assert owned and ours.parent == tmp_path / "torch_extensions" and len(ours.name) == 12
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ours))  # as pjray sets it for the build
    assert extensions_dir() == (ours, True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert extensions_dir() == (tmp_path / "mine", False)


def test_each_ninja_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """Two ninja releases would rebuild over each other's objects in one directory."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path))
    dirs = []
    for name in ("venv", "system"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ninja").write_text("#!/bin/sh\n")
        (tmp_path / name / "ninja").chmod(0o755)
        monkeypatch.setenv("PATH", str(tmp_path / name))
        dirs.append(extensions_dir()[0])
    assert dirs[0] != dirs[1]
    assert extensions_dir()[0] == dirs[1]  # the same ninja, the same directory


def _hold_then_die(path, ready):
    with held(path):
        ready.set()
        os._exit(0)  # killed while holding it: the kernel releases the flock


def test_the_guard_is_released_when_its_holder_dies(tmp_path):
    ready = multiprocessing.get_context("fork").Event()
    proc = multiprocessing.get_context("fork").Process(target=_hold_then_die, args=(tmp_path / "g", ready))
    proc.start()
    assert ready.wait(30)
    proc.join(30)
    t0 = time.monotonic()
    with held(tmp_path / "g"):
        pass
    assert time.monotonic() - t0 < 5
