"""The research scripts of benchmarks/ end to end at their smoke budgets (their numbers mean
nothing there). The looking study (`benchmarks/study_looking.py`): every variant trains with
GRPO from the shipped base judge (one disposition) with HF exports along its curve, every judge (the base judge
unforced and forced, each run at each step of the curve) is judged on the held-out tuples, and
the rows, intervals, per-item verdicts, table and plot are written; a second invocation reuses a
finished run and retrains one whose key names other code. The group-size study
(`benchmarks/group_size_study.py`): its runs, rows and report, and their reuse. The judge-reward
study (`benchmarks/study_judge_reward.py`): every arm, its evaluations, report and plot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

# Not in the default run of the suite (it is a script of benchmarks/, not of the package): run it
# with `pytest -m extended` before changing benchmarks/study_looking.py or what it calls.
pytestmark = [pytest.mark.slow, pytest.mark.extended]

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study_looking.py"


def run_study(*args: str) -> None:
    # In a process of its own, as a user runs it: its GRPO runs start Ray in that process.
    done = subprocess.run(
        [sys.executable, str(STUDY), "--smoke", "--bases", "one_disposition", *args],
        capture_output=True,
        text=True,
        timeout=30 * 60,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_looking_study_runs_every_variant_along_its_curve(tmp_path: Path, monkeypatch):
    out, work = tmp_path / "results", tmp_path / "work"
    run_study("--out", str(out), "--work", str(work))
    spec = importlib.util.spec_from_file_location("study_looking", STUDY)
    study = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "study_looking", study)  # its dataclasses look their module up
    spec.loader.exec_module(study)

    results = json.loads((out / "looking_study.json").read_text())
    rows = results["rows"]
    fields = {
        "variant",
        "base_judge",
        "seed",
        "steps",
        "kind",
        "image_following",
        "correct_first",
        "blind_correct_first",
        "disposition_image",
    }
    assert all(fields <= set(r) for r in rows)
    judges = {(r["variant"], r["steps"]) for r in rows}
    assert judges == {("base", 0), ("forced", 0), *((v, s) for v in study.VARIANTS for s in study.SMOKE.curve)}
    assert all(r["forced"] == (r["variant"] == "forced") for r in rows)
    assert all(0.0 <= r[m] <= 1.0 for r in rows for m in study.METRICS)
    # One disposition: its forced run writes nothing after its own "Image: X.", so it is its plain run.
    plain = {(r["kind"], r.get("part")): r["image_following"] for r in rows if r["variant"] == "base"}
    assert plain == {(r["kind"], r.get("part")): r["image_following"] for r in rows if r["forced"]}
    assert all(r["disposition_image"] == 0.0 for r in rows if not r["forced"])
    trained = [r for r in rows if r["variant"] in study.VARIANTS]
    assert all(
        r["train_reward"] is not None and r["reward_greedy"] is not None and r["reward_sampled"] is not None
        for r in trained
    )
    for cell in results["summary"]:
        for m in study.METRICS:
            boot = cell[m]["bootstrap"]
            assert boot["lo"] <= boot["mean"] <= boot["hi"], cell
    assert results["nulls"]["drop_contradicting"] == 0.25
    assert "none in" in results["setup"]["held_out"]  # every image shown is asserted unseen in training, by content
    verdicts = pq.read_table(out / "looking_study_items.parquet").to_pylist()
    per_judge = 2 * study.SMOKE.per_kind
    assert len(verdicts) == per_judge * (1 + len(study.VARIANTS) * len(study.SMOKE.curve))
    table = (out / "looking_study.md").read_text()
    assert "| one_disposition | forced | 0 |" in table and "| one_disposition | nested_levenshtein | 2 |" in table
    assert (out / "looking_study.png").stat().st_size > 0

    # A study in parts: a finished run of the same key is reused; one of other code is trained anew.
    marker = work / "one_disposition-independent_levenshtein-s0" / "study_run.json"
    recorded = json.loads(marker.read_text())
    recorded["key"]["code"] = "older code"
    marker.write_text(json.dumps(recorded))
    again = tmp_path / "again"
    run_study("--out", str(again), "--work", str(work))
    reused = {(r["variant"], r["reused"]) for r in json.loads((again / "looking_study.json").read_text())["runs"]}
    assert reused == {(v, v != "independent_levenshtein") for v in study.VARIANTS}
    assert json.loads(marker.read_text())["key"]["code"] != "older code"


GROUP_SIZE_STUDY = STUDY.parent / "group_size_study.py"


def test_the_group_size_study_runs_and_reuses_its_runs(tmp_path: Path):
    """`benchmarks/group_size_study.py --smoke`: three short trainings from the shipped base judge
    (two budgets, three group sizes), each with its held-out check; one row per run and kind with
    the fields the study reports, seed aggregates, table and plot; a second invocation trains
    nothing (every run's key is unchanged)."""
    out, work = tmp_path / "results", tmp_path / "work"
    command = [sys.executable, str(GROUP_SIZE_STUDY), "--smoke", "--out", str(out), "--work", str(work)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=30 * 60)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count(" trained ") == 3
    results = json.loads((out / "group_size.json").read_text())
    fields = {
        "G",
        "budget",
        "seed",
        "steps",
        "kind",
        "image_following",
        "correct_first",
        "zero_variance_groups",
        "step_s",
        "responses_per_s",
        "peak_mib",
        "phases_s",
    }
    assert all(fields <= set(r) for r in results["rows"])
    assert sorted({(r["budget"], r["G"]) for r in results["rows"]}) == [
        ("equal_prompts", 8),
        ("equal_samples", 2),
        ("equal_samples", 4),
    ]
    assert {r["kind"] for r in results["rows"]} == {"color", "size", "pooled"}
    assert all(0 <= r["image_following"] <= 1 and r["step_s"] > 0 and r["responses_per_s"] > 0 for r in results["rows"])
    assert all(r["peak_mib"]["learner"] > r["peak_mib"]["reward"] > 0 for r in results["rows"])
    assert len(results["aggregate"]) == 3 * 3
    assert "| 2 | 4 | 1 |" in (out / "group_size.md").read_text()
    assert (out / "group_size.png").read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run(command, capture_output=True, text=True, timeout=30 * 60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(" reused ") == 3 and " trained " not in again.stdout


JUDGE_REWARD_STUDY = STUDY.parent / "study_judge_reward.py"


def test_the_judge_reward_study_runs_every_arm(tmp_path: Path):
    """`benchmarks/study_judge_reward.py --quick`: every arm trains the base policy a few steps
    and is evaluated at its middle and last step beside the base policy; results, per-item
    verdicts, table and plot are written. The shipped judge stands in for the trained one (the
    default run's export costs minutes); a missing trained judge is refused before any run."""
    from pjray.recipes.base_judge import SHIPPED

    out = tmp_path / "results"
    command = [sys.executable, str(JUDGE_REWARD_STUDY), "--quick", "--out", str(out)]
    missing = subprocess.run([*command, "--trained-judge", str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 2 and "run `pjray train` first" in missing.stderr
    done = subprocess.run(
        [*command, "--trained-judge", str(SHIPPED / "hf_model")], capture_output=True, text=True, timeout=30 * 60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "quick.json").read_text())
    arms = ("rule", "trained", "base", "control")
    assert set(results["runs"]) == {f"{a}_0" for a in arms}
    assert set(results["summary"]) == {*arms, "hypotheses"}
    assert all(set(r["steps"]) == {"2", "4"} for r in results["runs"].values())
    assert all("judge/calls" in r["train"] for key, r in results["runs"].items() if not key.startswith("rule"))
    items = pq.read_table(out / "quick_items.parquet").to_pylist()
    per_evaluation = 2 * 2 * 6 * 2  # 2 questions a kind x colour cell, 2 kinds, 6 colours, 2 answers each
    assert len(items) == per_evaluation * (1 + len(arms) * 2)
    assert "| base policy |" in (out / "quick.md").read_text()
    assert (out / "quick.png").read_bytes()[:4] == b"\x89PNG"
