"""The bias study (`benchmarks/study_bias.py`) end to end at its smoke budget: every variant trains
with GRPO from the base judge, every judge is evaluated on held-out scenes (diagnosis, batch
ranking on both constructions, image swap and grey image, the disposition's probability), and
the results are written with their hierarchical-bootstrap intervals; a second invocation reuses
a finished run and retrains one whose marker names another base judge. Its numbers mean nothing
at this budget; the study's --quick mode (hours on 2 cores) does not fit the test suite. Runs
after test_default_run_learns.py, which builds the base judge into the user's cache on a fresh
machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Not in the default run of the suite (it is a script of benchmarks/, not of the package): run it
# with `pytest -m extended` before changing benchmarks/study_bias.py or what it calls.
pytestmark = [pytest.mark.slow, pytest.mark.extended]

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study_bias.py"


def run_study(*args: str) -> None:
    # In a process of its own, as a user runs it: its GRPO runs start Ray in that process.
    done = subprocess.run([sys.executable, str(STUDY), "--smoke", *args], capture_output=True, text=True, timeout=30 * 60)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_bias_study_runs_every_variant_and_writes_results_with_intervals(tmp_path: Path, monkeypatch):
    out, work = tmp_path / "results", tmp_path / "work"
    run_study("--out", str(out), "--work", str(work))
    spec = importlib.util.spec_from_file_location("study_bias", STUDY)
    study = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "study_bias", study)  # its dataclasses look their module up
    spec.loader.exec_module(study)  # its variants, outcome groups and budgets

    results = json.loads((out / "bias_study.json").read_text())
    assert set(results["judges"]) == {"base", *study.VARIANTS} and "pairwise" not in results["judges"]
    seeds = len(study.SMOKE.seeds)
    for name, judge in results["judges"].items():
        outcomes = judge["outcomes"]
        assert set(outcomes) == set(study.GROUPS)
        for group, metrics in study.GROUPS.items():
            assert set(outcomes[group]) == {"pooled", "color", "size"}
            for kind, row in outcomes[group].items():
                assert set(row) == set(metrics)
                for metric, cell in row.items():
                    assert len(cell["per_seed"]) == (1 if name == "base" else seeds), (name, group, metric)
                    if cell["mean"] is not None:
                        assert cell["lo"] <= cell["mean"] <= cell["hi"], (name, group, kind, metric, cell)
                    if name != "base":
                        change = cell["change"]
                        if change["mean"] is not None:
                            assert change["lo"] <= change["mean"] <= change["hi"], (name, group, kind, metric, change)
                        if metrics[metric]:
                            assert 0 <= cell["seeds_improved"] <= seeds
        if name != "base":
            assert [r["seed"] for r in judge["runs"]] == list(study.SMOKE.seeds)
            assert not any(r["reused"] for r in judge["runs"])
    # The disposition probability is a probability; the looking outcomes are rates of held-out items.
    p_image = results["judges"]["base"]["outcomes"]["diagnosis"]["pooled"]["p_image"]
    assert 0.0 <= p_image["mean"] <= 1.0
    for construction in ("independent", "nested"):
        text_only = results["baselines"][f"ranking_{construction}"]["pooled"]
        assert text_only["chance_correct_first"] == pytest.approx(1 / 3)
    setup = results["setup"]
    assert setup["budget"]["steps"] == study.SMOKE.steps
    assert setup["eval_items"] == {"diagnosis": study.SMOKE.eval_items, "independent": study.SMOKE.eval_items, "nested": study.SMOKE.eval_items}
    assert "none in" in setup["held_out_check"]  # evaluation items asserted unseen in training, by content
    assert set(setup["seconds"]["eval"]) == set(results["judges"])
    table = (out / "bias_study.md").read_text()
    assert "## Primary outcomes" in table and "| nested_kendall |" in table and "text-only ranker" in table
    assert (out / "bias_study.png").stat().st_size > 0

    # A study in parts: a finished run of the same base judge is reused; one whose marker names
    # another base judge is trained anew.
    marker = work / "no_perception-s0" / "study_run.json"
    recorded = json.loads(marker.read_text())
    recorded["key"]["base_judge"]["weights_sha256"] = "another judge"
    marker.write_text(json.dumps(recorded))
    again = tmp_path / "again"
    run_study("--out", str(again), "--work", str(work), "--variants", "nested_kendall,no_perception", "--seeds", "0")
    rerun = json.loads((again / "bias_study.json").read_text())
    assert set(rerun["judges"]) == {"base", "nested_kendall", "no_perception"}
    assert [r["reused"] for r in rerun["judges"]["nested_kendall"]["runs"]] == [True]
    assert [r["reused"] for r in rerun["judges"]["no_perception"]["runs"]] == [False]
    assert json.loads(marker.read_text())["key"]["base_judge"] == setup["base_judge_id"]
