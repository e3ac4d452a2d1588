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


class Tracker:
    """Logs step metrics to W&B and to `<run_dir>/metrics.jsonl`."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, config: dict[str, Any], resume: bool):
        self.run_dir = run_dir
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
