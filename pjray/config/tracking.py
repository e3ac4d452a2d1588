"""`tracking.*`: experiment tracking (W&B beside metrics.jsonl, pjray.tracking)."""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import opt


@dataclass(frozen=True)
class TrackingConfig:
    wandb: bool = True
    project: str = "pjray"
    name: str = ""  # empty: the run directory's name
    group: str = ""
    mode: str = opt("auto", choices=("auto", "online", "offline"))  # auto: offline without an API key

    def check(self) -> None:
        """Each field's own rule (`opt`) is all there is."""
