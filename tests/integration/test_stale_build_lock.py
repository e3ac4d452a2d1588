"""A learner rank starts past the build lock that a killed DeepSpeed op build left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pjray.models.tiny import build_tiny_judge
from pjray.rl.ds_ops import TORCH_LOCK, extensions_dir


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("judge"), arch="qwen2_vl", seed=0))


def test_a_learner_starts_past_a_build_lock_a_killed_build_left(judge_dir: str) -> None:
    """A DeepSpeed op build killed mid-way leaves torch's `lock` file; a later rank removes it
    (with a warning) and starts, rather than waiting on it forever."""
    root, owned = extensions_dir()
    assert owned  # pjray's own directory for this environment
    lock = root / "deepspeed_shm_comm" / TORCH_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    start = (
        "import sys; sys.path.insert(0, {here!r}); import test_learner as t; "
        "rank = t._direct_rank({judge!r}, 1, 2); print('started', type(rank).__name__)"
    ).format(here=str(Path(__file__).parent), judge=judge_dir)
    done = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started LearnerRank" in done.stdout
    assert f"removing a stale DeepSpeed build lock {lock}" in done.stdout
    assert not lock.exists()
