"""`trainer.keep_best`: the judge of the best validation so far, kept beside the last one.

Every `eval.every_steps` steps the trainer's validation logs its metrics; when the one named by
`trainer.keep_best` beats the best so far (larger with `keep_best_mode=max`, smaller with
`min`), the trainer writes the judge to `<run_dir>/hf_model_best` and this records the step and
value in `<run_dir>/best.json`, which a resumed run reads back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pjray.config import ConfigError
from pjray.console import BEST

BEST_MODEL = "hf_model_best"


def improves(value: float, best: float | None, mode: str) -> bool:
    """Whether `value` beats `best` (None: nothing yet); a NaN never does."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


class BestJudge:
    """The best value so far of one validation metric, persisted in best.json."""

    def __init__(self, run_dir: Path, metric: str, mode: str):
        self.path = run_dir / BEST
        self.metric, self.mode = metric, mode
        self.best: dict[str, Any] | None = None
        if self.path.is_file():
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("metric") == metric and saved.get("mode") == mode:
                self.best = saved

    def value(self, metrics: dict[str, float]) -> float:
        if self.metric not in metrics:
            logged = sorted(k for k in metrics if k.startswith("eval/"))
            raise ConfigError(
                f"trainer.keep_best={self.metric}: the validation logged no such metric (it logged "
                f"{', '.join(logged) or 'nothing'})"
            )
        return float(metrics[self.metric])

    def improves(self, metrics: dict[str, float]) -> bool:
        return improves(self.value(metrics), None if self.best is None else self.best["value"], self.mode)

    def record(self, step: int, metrics: dict[str, float], model_dir: Path) -> None:
        """After the judge of `step` was written to `model_dir`."""
        self.best = {
            "metric": self.metric,
            "mode": self.mode,
            "step": step,
            "value": self.value(metrics),
            "model": str(model_dir),
        }
        self.path.write_text(json.dumps(self.best, indent=2))
