"""A policy trained with a judge as its reward, end to end on CPU: `configs/policy_demo.yaml` as
shipped (the shipped base policy rewarded by the shipped base judge and the rule), a few steps
and a resume."""

from __future__ import annotations

import json

import pytest

from pjray.cli import main
from pjray.config import load

pytestmark = pytest.mark.slow


def test_policy_demo_trains_with_a_judge_reward_and_resumes(ray_local, tmp_path, capsys):
    run_dir = tmp_path / "policy"
    overrides = [f"trainer.run_dir={run_dir}", "trainer.save_every=2", "tracking.wandb=false"]
    assert main(["train", "--config", "configs/policy_demo.yaml", *overrides, "trainer.steps=2"]) == 0
    # The same command with more steps continues from the checkpoint (trainer.resume=auto).
    assert main(["train", "--config", "configs/policy_demo.yaml", *overrides, "trainer.steps=3"]) == 0
    cfg = load("configs/policy_demo.yaml", overrides)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in steps] == [1.0, 2.0, 3.0]
    # Identical answers are judged once, so a group of fewer distinct answers takes fewer calls.
    per_step = cfg.trainer.prompts_per_step * cfg.reward.judge.calls_per_group(cfg.algo.group_size)
    for m in steps:
        assert 0 < m["judge/calls"] <= per_step
        assert 0.0 <= m["judge/unreadable"] <= 1.0
        assert 0.0 < m["judge/time_share"] < 1.0
        assert 0.0 <= m["reward/rule_mean"] <= 1.0 and 0.0 <= m["reward/judge_mean"] <= 1.0
        # mix: each content reward is the average of the rule's and the judge's.
        assert m["reward/ranking_mean"] == pytest.approx((m["reward/rule_mean"] + m["reward/judge_mean"]) / 2)
        assert m["memory/judge_peak_mib"] > 50
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert "reward judge: the shipped base judge" in capsys.readouterr().out


def test_a_missing_judge_directory_fails_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "hf_model"
    code = main(["train", "--config", "configs/policy_demo.yaml", f"reward.judge.model={missing}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1
    assert err[0].endswith(f"reward.judge.model: {missing}: no such directory (and not a hub id owner/name)")
