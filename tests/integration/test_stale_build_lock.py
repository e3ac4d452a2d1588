"""A learner rank starts past the build lock that a killed DeepSpeed op build left behind: it
builds no op at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pjray.models.tiny import build_tiny_judge


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("judge"), arch="qwen2_vl", seed=0))


def test_a_learner_starts_past_a_build_lock_a_killed_build_left(judge_dir: str, tmp_path: Path) -> None:
    """torch waits without a limit on the `lock` file a killed op build leaves in the op's build
    directory. With one there, a rank starts (in the time of a start, not a build), prints nothing
    about an op, and has not loaded DeepSpeed's shared-memory op."""
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    start = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_learner as t; "
        f"rank = t._direct_rank({judge_dir!r}, 1, 2); print('started', type(rank).__name__); "
        "print('op loaded', hasattr(torch.ops.deepspeed, 'inference_all_reduce_'))"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started LearnerRank" in done.stdout
    assert "op loaded False" in done.stdout
    assert "built successfully" not in done.stdout + done.stderr
    assert lock.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["deepspeed_shm_comm"]
