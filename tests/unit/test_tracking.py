"""Tracking: metrics.jsonl always, W&B offline without an API key, resumed runs keep their id."""

import json

from pjray.config import TrackingConfig
from pjray.tracking import Tracker, truncate_metrics, wandb_mode


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


def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(tmp_path):
    """Killed at step 4 with a checkpoint at 2: the resumed run logs 3 and 4 again, once."""
    cfg = TrackingConfig(wandb=False)
    first = Tracker(cfg, tmp_path, {}, resume=False, start_step=0)
    for step in (1, 2, 3, 4):
        first.log({"reward/mean": float(step)}, step=step)
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')  # a line cut by the kill
    resumed = Tracker(cfg, tmp_path, {}, resume=True, start_step=2)
    for step in (3, 4, 5):
        resumed.log({"reward/mean": 10.0 + step}, step=step)
    resumed.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in rows] == [1.0, 2.0, 13.0, 14.0, 15.0]


def test_truncation_leaves_a_file_within_its_steps_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    before = path.stat().st_mtime_ns
    assert truncate_metrics(path, 2) == 0 and path.stat().st_mtime_ns == before
    assert truncate_metrics(path, 0) == 2 and path.read_text() == ""
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0
