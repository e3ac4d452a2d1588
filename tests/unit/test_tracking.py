"""Tracking: metrics.jsonl always, W&B offline without an API key, resumed runs keep their id."""

import json

from pjray.config import TrackingConfig
from pjray.tracking import Tracker, wandb_mode


def test_mode_auto_is_offline_without_a_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(TrackingConfig()) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(TrackingConfig()) == "online"
    assert wandb_mode(TrackingConfig(mode="offline")) == "offline"


def test_offline_run_writes_jsonl_and_wandb_files(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = TrackingConfig(project="pjray-test")
    tracker = Tracker(cfg, tmp_path, {"algo": {"group_size": 4}}, resume=False)
    tracker.log({"reward/mean": 0.5}, step=1)
    tracker.log({"reward/mean": 0.75}, step=2)
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))

    resumed = Tracker(cfg, tmp_path, {}, resume=True)
    resumed.log({"reward/mean": 1.0}, step=3)
    resumed.close()
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
