"""The GPU check scripts' failure accounting, on CPU: benchmarks/steps.sh, and gpu_smoke.sh and
gpu_day.sh driven end to end by a stand-in interpreter.

No step of those scripts can run here (they need CUDA and vLLM's GPU build). What is checked is
that they cannot pass when a step fails: every step runs whatever happened before it, a failed or
overdue step makes the script exit non-zero, and the summary names it. The stand-in for Python
(`PYTHON=`, which the scripts read) is a fake named as such: it records each command line, says
that two GPUs are visible, and fails the commands that contain a chosen string.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

FAKE_PYTHON = """#!/usr/bin/env bash
# Stand-in for Python in the GPU scripts: records the command, reports 2 GPUs, fails on request.
printf '%s\\n' "$*" >> "$FAKE_PYTHON_LOG"
case "$*" in *device_count*) echo 2 ;; esac
if [ -n "${FAKE_PYTHON_FAIL:-}" ] && [[ "$*" == *"$FAKE_PYTHON_FAIL"* ]]; then
  echo "fake python: failing on purpose" >&2
  exit 3
fi
exit 0
"""


def _rows(summary: Path) -> list[list[str]]:
    """The summary table's rows, as [index, step, result, seconds, log]."""
    lines = [line for line in summary.read_text().splitlines() if re.match(r"\| \d+ \|", line)]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_every_step_runs_and_a_failed_or_overdue_one_fails_the_script(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    script = f"""
        . {BENCHMARKS / "steps.sh"}
        steps_begin {summary} demo "a note"
        step first 30 true
        step broken 30 bash -c 'echo about to fail; exit 7'
        step overdue 1 sleep 30
        skip "two GPUs" "needs 2 GPUs, 1 visible"
        step last 30 true
        steps_end
    """
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = _rows(summary)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "first", "PASS"),
        ("2", "broken", "FAIL (exit 7)"),
        ("3", "overdue", "FAIL (over its 1 s limit)"),
        ("4", "two GPUs", "skipped: needs 2 GPUs, 1 visible"),
        ("5", "last", "PASS"),
    ]
    assert (tmp_path / rows[1][4]).read_text() == "about to fail\n"  # each step's output in its log
    text = summary.read_text()
    assert "a note" in text
    assert text.rstrip().endswith("demo: 2 passed, 2 failed, 1 skipped; failed: broken, overdue")

    passing = subprocess.run(
        ["bash", "-c", f". {BENCHMARKS / 'steps.sh'}; steps_begin {summary} ok; step a 30 true; steps_end"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert passing.returncode == 0 and summary.read_text().rstrip().endswith("ok: 1 passed, 0 failed, 0 skipped")


def _run(script: str, tmp_path: Path, fail: str = "") -> tuple[subprocess.CompletedProcess, list[list[str]], list[str]]:
    """Run `script` with the stand-in interpreter failing the commands that contain `fail`:
    the finished process, its summary's rows and the commands it ran."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log, root = tmp_path / "calls.log", tmp_path / "run"
    environ = {**os.environ, "PYTHON": str(fake), "FAKE_PYTHON_LOG": str(log), "FAKE_PYTHON_FAIL": fail}
    done = subprocess.run(
        [str(BENCHMARKS / script), str(root)], capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=300
    )
    return done, _rows(root / "summary.md"), log.read_text().splitlines()


SMOKE_STEPS = [
    "VL engine checks (CUDA graphs)",
    "parity V1 runner",
    "parity V2 runner",
    "parity TP=2",
    "GRPO on vLLM (test_vllm_gpu.py)",
    "train colocated",
    "gaps colocated",
    "train split",
    "gaps split",
    "train sync-k0",
    "gaps sync-k0",
    "train async-k1",
    "gaps async-k1",
    "async against sync",
]


@pytest.mark.parametrize("fail", ["", "gpu_vllm_parity.py --tp 2"])
def test_gpu_smoke_fails_when_a_step_fails_and_runs_every_step(tmp_path: Path, fail: str) -> None:
    done, rows, calls = _run("gpu_smoke.sh", tmp_path, fail)
    assert [r[1] for r in rows] == SMOKE_STEPS, done.stdout
    failed = [r[1] for r in rows if r[2].startswith("FAIL")]
    if fail:
        assert done.returncode == 1 and failed == ["parity TP=2"]
        assert "failed: parity TP=2" in done.stdout
    else:
        assert done.returncode == 0 and failed == [], done.stdout
    # The steps after the failed one ran: the async pair is the last training.
    assert any("trainer.max_staleness=1" in c for c in calls)
    # CUDA graphs stay on: nothing asks vLLM for its eager mode.
    assert not any("enforce_eager" in c or "--eager" in c for c in calls)


def test_gpu_day_runs_its_checks_in_order_and_fails_when_the_recipe_fails(tmp_path: Path) -> None:
    done, rows, calls = _run("gpu_day.sh", tmp_path, "configs/qwen3vl_4b.yaml")
    names = [r[1] for r in rows]
    assert names[:7] == [
        "install torch==2.13.0",
        "install pjray[gpu,test]",
        "install flash-attn",
        "pip check",
        "pinned versions",
        "CUDA GPUs",
        "NCCL sync group (GPU-marked tests)",
    ]
    assert names[7:-3] == SMOKE_STEPS
    assert names[-3] == "recipe qwen3vl_4b, 3 steps (split: 1 learner + 1 engine GPUs, NCCL)"
    assert names[-2] == "recipe qwen3vl_4b, ZeRO-3 and offload during generation, 3 steps (colocated on 2 GPUs)"
    # The judge at work needs 8 GPUs: listed as skipped here, not failed.
    assert names[-1] == "recipe policy_qwen25vl_7b, 3 steps" and rows[-1][2].startswith("skipped: needs 8 GPUs")
    # The ZeRO-3 step runs the same recipe file, so the stand-in fails it too.
    assert done.returncode == 1 and [r[1] for r in rows if r[2].startswith("FAIL")] == names[-3:-1], done.stdout
    # In order: the install before anything else, the recipe, then its ZeRO-3 run last.
    assert calls[0].startswith("-m pip install torch==")
    assert calls.index("-m pip install -e .[gpu,test]") < min(i for i, c in enumerate(calls) if "pytest" in c)
    assert "configs/qwen3vl_4b.yaml" in calls[-2] and "ray.num_gpus=2" in calls[-2]
    zero3 = calls[-1].split()
    assert "configs/qwen3vl_4b.yaml" in zero3 and "learner.num_ranks=2" in zero3
    for key in ("learner.zero_stage=3", "learner.offload_during_generation=true", "algo.filter_zero_std=true"):
        assert key in zero3
    assert any(c.startswith("model.stage_dir=") for c in zero3)  # the hub id staged, then loaded partitioned
    assert any("-m gpu tests/unit/test_sync_group.py" in c for c in calls)
