"""benchmarks/step_table.py: the per-step table the GPU check scripts print after a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_table.py"


def test_wall_phases_in_loop_order_then_the_figures(tmp_path: Path) -> None:
    rows = [
        {
            "training/global_step": step,
            "timing_s/update": 0.5,
            "timing_s/step": 2.0 + step,
            "timing_s/gen": 1.0,
            "timing_s/sync": 0.01,
            "timing_s/gen_compute": 0.9,
            "timing_s/gen_overhead": 0.1,
            "timing_s/compute": 1.4,
            "timing_s/adv": 0.001,
            "reward/mean": 0.25 * step,
            "rollout/logprob_diff_max": 3e-3,
        }
        for step in (1, 2)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(SCRIPT), str(metrics)], capture_output=True, text=True, check=True).stdout
    head, *body = out.splitlines()
    assert head.split() == [
        "step",
        "step",
        "s",
        "gen",
        "s",
        "update",
        "s",
        "sync",
        "s",
        "adv",
        "s",
        "reward",
        "logprob_diff_max",
    ]
    assert [line.split()[:2] for line in body] == [["1", "3"], ["2", "4"]]
    assert body[1].split()[-2:] == ["0.5", "0.003"]


def test_a_run_without_steps_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "metrics.jsonl")], capture_output=True, text=True
    )
    assert done.returncode == 1 and "logs no step" in done.stderr


def test_a_gap_over_the_limit_on_an_on_policy_step_fails_the_check(tmp_path: Path) -> None:
    """Only steps sampled by the learner's own weights count: an async step's gap is the policy's
    change too. A run that logs no gap at all cannot pass a gap check."""
    rows = [
        {"training/global_step": 1, "rollout/staleness_max": 0.0, "rollout/logprob_diff_max": 2e-3},
        {"training/global_step": 2, "rollout/staleness_max": 1.0, "rollout/logprob_diff_max": 0.4},
        {"training/global_step": 3, "rollout/staleness_max": 0.0, "rollout/logprob_diff_max": 0.3},
    ]
    metrics = tmp_path / "metrics.jsonl"

    def run(rows: list[dict], *args: str) -> subprocess.CompletedProcess:
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.run([sys.executable, str(SCRIPT), str(metrics), *args], capture_output=True, text=True)

    done = run(rows, "--max-diff-max", "1e-2")
    assert done.returncode == 1 and "step 3: rollout/logprob_diff_max = 0.3 > 0.01" in done.stderr
    assert "step 2" not in done.stderr and done.stdout.count("\n") == 4  # the table is printed first
    assert run(rows[:2], "--max-diff-max", "1e-2").returncode == 0
    assert run(rows, "--max-diff-max", "0.5").returncode == 0
    missing = run(rows, "--max-diff-mean", "1e-2")
    assert missing.returncode == 1 and "no on-policy step logs rollout/logprob_diff_mean" in missing.stderr
