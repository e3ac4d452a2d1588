"""Experiment tracking: W&B (offline unless an API key is configured) plus a local JSONL.

Every metric a run logs goes to `<run_dir>/metrics.jsonl` as well, so a run is inspectable
without W&B and a resumed run appends to the same file.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from pjray.config import TrackingConfig


def wandb_mode(cfg: TrackingConfig) -> str:
    """`auto` means online only when an API key is available; never block on a login prompt."""
    if cfg.mode != "auto":
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    return "offline"


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop the rows of a metrics JSONL logged after `last_step` (and a line cut by a kill);
    returns how many were dropped. A run resumed from step N logs N+1... again, and its
    curves must not hold those steps twice."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if row.get("step", 0) <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        partial = path.with_suffix(".jsonl.partial")
        partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        partial.replace(path)
    return dropped


class Tracker:
    """Logs step metrics to W&B and to `<run_dir>/metrics.jsonl`.

    `start_step`: the step a training (re)starts from; rows of metrics.jsonl past it are dropped
    first, and a resumed W&B run continues the stored run id from there."""

    def __init__(
        self, cfg: TrackingConfig, run_dir: Path, config: dict[str, Any], resume: bool, start_step: int | None = None
    ):
        self.run_dir = run_dir
        if start_step is not None:
            truncate_metrics(run_dir / "metrics.jsonl", start_step)
        self.jsonl = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self.run = None
        if cfg.wandb:
            import wandb

            # A stable id derived from the run directory lets a resumed run continue its W&B run.
            run_id_file = run_dir / "wandb_run_id"
            if resume and run_id_file.exists():
                run_id = run_id_file.read_text().strip()
            else:
                run_id = uuid.uuid4().hex[:12]
                run_id_file.write_text(run_id)
            self.run = wandb.init(
                project=cfg.project,
                name=cfg.name or run_dir.name,
                group=cfg.group or None,
                dir=str(run_dir),
                config=config,
                mode=wandb_mode(cfg),
                id=run_id,
                resume="allow",
                settings=wandb.Settings(silent=True, console="off"),
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.run is not None:
            self.run.finish()
            self.run = None
