"""One OmegaConf structured schema for every pjray job, a module per section.

`load(path, overrides)` merges a YAML file and dotted overrides (`algo.group_size=8`) onto the
dataclass defaults and returns a `Config` object. Unknown keys, wrong types and impossible
combinations raise `ConfigError` naming the key; nothing here rewrites what the user asked for.

- `fields`: the errors, and `opt`, which writes a field's own rule (its choices or range) beside it.
- one module per section (`task`, `model`, `data`, `rollout`, `reward`, `algo`, `learner`, `trainer`,
  `tracking`, `cluster` for `ray.*`, `ppjd`, `eval`, `sft`): its dataclass, its constants, and
  its `check()`, the rules that read only that section's fields.
- `cross`: the rules that tie two or more sections, one function per tie.
- `root`: the `Config` root, `validate` (field rules, derived values, sections, ties), `load`.

Derived values are resolved once: `algo.rollout_is=auto` by `validate`, the image budget by
`ModelConfig.image_budget`. The package imports only the standard library, omegaconf and
pjray.errors, so loading a config starts no model stack; every name is re-exported here.
"""

from pjray.config.algo import AlgoConfig
from pjray.config.cluster import RayConfig
from pjray.config.data import CONSTRUCTIONS, DATA_COLUMNS, KINDS, SCENE_MAX_CANDIDATES, SPLITS, DataConfig
from pjray.config.eval import EvalConfig, is_outputs_file
from pjray.config.fields import CHECK, Check, ConfigError, PathError, opt
from pjray.config.learner import LearnerConfig
from pjray.config.model import VLLM_LORA_MODULES, VLLM_LORA_RANKS, ImageBudget, LoraConfig, ModelConfig
from pjray.config.ppjd import HUB_ID, PPJDConfig
from pjray.config.reward import JudgeRewardConfig, RewardConfig
from pjray.config.rollout import RolloutConfig
from pjray.config.root import Config, load, to_dict, to_yaml, validate
from pjray.config.sft import SFTConfig
from pjray.config.task import TaskConfig
from pjray.config.tracking import TrackingConfig
from pjray.config.trainer import TrainerConfig

__all__ = [
    "CHECK",
    "CONSTRUCTIONS",
    "DATA_COLUMNS",
    "HUB_ID",
    "KINDS",
    "SCENE_MAX_CANDIDATES",
    "SPLITS",
    "VLLM_LORA_MODULES",
    "VLLM_LORA_RANKS",
    "AlgoConfig",
    "Check",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ImageBudget",
    "JudgeRewardConfig",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "PPJDConfig",
    "PathError",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainerConfig",
    "is_outputs_file",
    "load",
    "opt",
    "to_dict",
    "to_yaml",
    "validate",
]
