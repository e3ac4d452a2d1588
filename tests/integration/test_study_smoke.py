"""The bias study (`benchmarks/study_bias.py`) end to end at its smoke budget: every variant trains
with GRPO from the base judge, every judge is evaluated on held-out scenes, and the results are
written with their confidence intervals. Its numbers mean nothing at this budget; the study's
--quick mode (about an hour on 2 cores) does not fit the test suite. Runs after
test_default_run_learns.py, which builds the base judge into the user's cache on a fresh machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study_bias.py"


def test_the_bias_study_runs_every_variant_and_writes_results_with_intervals(tmp_path: Path, monkeypatch):
    # In a process of its own, as a user runs it: its GRPO runs start Ray in that process.
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(STUDY), "--smoke", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=30 * 60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("study_bias", STUDY)
    study = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "study_bias", study)  # its dataclasses look their module up
    spec.loader.exec_module(study)  # its variants, metrics and budgets

    results = json.loads((out / "bias_study.json").read_text())
    assert set(results["judges"]) == {"base", *study.VARIANTS}
    for name, row in results["judges"].items():
        for metric in study.METRICS:
            ci = row[metric]
            assert ci["lo"] <= ci["mean"] <= ci["hi"], (name, metric, ci)
            if name != "base":
                change = row[metric + "_change"]
                assert change["lo"] <= change["mean"] <= change["hi"], (name, metric, change)
        if name != "base":
            assert len(row["reward_first_last"]) == len(study.SMOKE.seeds)
    setup = results["setup"]
    assert setup["budget"]["steps"] == study.SMOKE.steps
    assert "none among" in setup["held_out_check"]  # evaluation scenes asserted unseen in training
    table = (out / "bias_study.md").read_text()
    assert "| judge |" in table and "| kendall |" in table
    assert (out / "bias_study.png").stat().st_size > 0
