"""The `Config` root of every section, and `load`: defaults <- YAML <- overrides, validated."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pjray.config import cross
from pjray.config.algo import AlgoConfig
from pjray.config.cluster import RayConfig
from pjray.config.data import DataConfig
from pjray.config.eval import EvalConfig
from pjray.config.fields import ConfigError, PathError, check_fields
from pjray.config.learner import LearnerConfig
from pjray.config.model import ModelConfig
from pjray.config.ppjd import PPJDConfig
from pjray.config.reward import RewardConfig
from pjray.config.rollout import RolloutConfig
from pjray.config.sft import SFTConfig
from pjray.config.task import TaskConfig
from pjray.config.tracking import TrackingConfig
from pjray.config.trainer import TrainerConfig


@dataclass(frozen=True)
class Config:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    ppjd: PPJDConfig = field(default_factory=PPJDConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def validate(cfg: Config) -> Config:
    """Check every field's own rule (`opt`), resolve the derived values, then check each
    section's combinations (its `check()`), then the ties between sections
    (`pjray.config.cross`); raise ConfigError naming the key. Returns the config the rest of
    pjray reads: frozen, every derived value resolved."""
    check_fields(cfg, "")
    # algo.rollout_is=auto: TIS per token (`token`) where rollout workers sample, `none` with the
    # hybrid engine (its samples are the learner's own). Resolved here only; the rest reads it.
    if cfg.algo.rollout_is == "auto":
        level = "none" if cfg.rollout.backend == "hybrid" else "token"
        cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, rollout_is=level))
    for section in dataclasses.fields(cfg):
        getattr(cfg, section.name).check()
    cross.check(cfg)
    return cfg


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, validated. Returns a `Config` object."""
    try:
        merged: DictConfig = OmegaConf.structured(Config)
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise PathError(f"--config: {path}: no such file")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        message = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"{key}: {message}" if key else message) from None
    assert isinstance(cfg, Config)
    return validate(cfg)


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain containers (for W&B and the run directory)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
