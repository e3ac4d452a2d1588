"""One OmegaConf structured schema for every pjray job.

`load(path, overrides)` merges a YAML file and dotted overrides (`algo.group_size=8`) onto the
dataclass defaults and returns a `Config` object. Unknown keys, wrong types and impossible
combinations raise `ConfigError` naming the key; nothing here rewrites what the user asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


# Scene answers have few enough facts that at most this many strictly ordered error levels exist
# (pjray.ppjd.perturb.MAX_CANDIDATES; kept here so loading a config never imports torch).
SCENE_MAX_CANDIDATES = 6


class ConfigError(ValueError):
    """A bad config: the message names the offending key."""


@dataclass
class ModelConfig:
    # HF directory or hub id of the judge. Empty: build a tiny random judge of `tiny_arch`
    # inside the run directory (the offline CPU default).
    path: str = ""
    tiny_arch: str = "qwen2_vl"  # qwen2_vl | qwen2_5_vl | qwen3_vl
    dtype: str = "float32"  # float32 | bfloat16
    freeze_vision: bool = True
    gradient_checkpointing: bool = False
    # Append "<think>\n" after the generation prompt, as the released training code does.
    think_prefix: bool = True


@dataclass
class DataConfig:
    source: str = "scenes"  # scenes | parquet
    path: str = ""  # parquet file or directory of PPJD rows (source=parquet)
    num_items: int = 256  # scenes: how many ranked tuples to build
    num_candidates: int = 3  # K
    image_size: int = 96  # scenes: square image side in pixels
    seed: int = 0


@dataclass
class RolloutConfig:
    backend: str = "hf"  # hf | vllm
    num_workers: int = 1
    num_cpus_per_worker: float = 0.5
    num_gpus_per_worker: float = 0.0
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # vLLM only.
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    max_model_len: int = 4096


@dataclass
class RewardConfig:
    # "module:function" of a custom `(response_text, target) -> float` reward used instead of
    # the judge reward (verl's custom_reward_function); empty: format x ranking.
    function: str = ""
    metric: str = "levenshtein"  # levenshtein (the paper) | kendall (the released code)
    style: str = "ranking"  # ranking (letters best -> worst) | scores (one 1-10 score each)
    num_workers: int = 1
    num_cpus_per_worker: float = 0.25
    # Subtracted per response token beyond `length_penalty_from`; 0 disables.
    length_penalty: float = 0.0
    length_penalty_from: int = 0


@dataclass
class AlgoConfig:
    group_size: int = 4  # n responses per prompt
    norm_adv_by_std: bool = True  # False: Dr.GRPO (mean only)
    adv_eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 3.0  # 0 disables
    kl_coef: float = 0.01  # k3 ("low_var_kl") in the loss; 0 disables and drops the reference model
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    # Drop groups whose rewards all equal (zero advantage) and refill with fresh prompts.
    filter_zero_std: bool = False
    max_refill_rounds: int = 2
    # Optimizer steps per training step: the batch is split into this many mini-batches, each
    # seen `ppo_epochs` times. 1 and 1 is on-policy GRPO (old logprobs = current, no extra pass).
    ppo_mini_batches: int = 1
    ppo_epochs: int = 1


@dataclass
class LearnerConfig:
    num_ranks: int = 1
    num_cpus_per_rank: float = 0.5
    num_gpus_per_rank: float = 0.0
    zero_stage: int = 2
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    bf16: bool = False
    master_port: int = 0  # 0: pick a free port


@dataclass
class TrainerConfig:
    steps: int = 20
    prompts_per_step: int = 8
    seed: int = 0
    run_dir: str = "runs/demo"
    save_every: int = 10  # 0: only at the end
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | disable | a checkpoint directory
    export_hf: bool = True
    sync_bucket_mb: int = 64
    max_step_retries: int = 2  # a step is retried when a rollout or reward worker dies


@dataclass
class TrackingConfig:
    wandb: bool = True
    project: str = "pjray"
    name: str = ""  # empty: the run directory's name
    group: str = ""
    mode: str = "auto"  # auto (offline without an API key) | online | offline


@dataclass
class RayConfig:
    # Empty: RAY_ADDRESS if set (as under `ray job submit`), else a local cluster.
    address: str = ""
    num_cpus: int = 0  # local cluster only; 0: all cores
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "model.tiny_arch": ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
    "model.dtype": ("float32", "bfloat16"),
    "data.source": ("scenes", "parquet"),
    "rollout.backend": ("hf", "vllm"),
    "reward.metric": ("levenshtein", "kendall"),
    "reward.style": ("ranking", "scores"),
    "algo.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "learner.lr_schedule": ("constant", "cosine"),
    "tracking.mode": ("auto", "online", "offline"),
    "ray.placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
}

_POSITIVE: tuple[str, ...] = (
    "data.num_items", "data.image_size", "rollout.num_workers", "rollout.max_new_tokens",
    "rollout.tensor_parallel_size", "rollout.max_model_len", "reward.num_workers",
    "algo.group_size", "algo.ppo_mini_batches", "algo.ppo_epochs", "learner.num_ranks", "learner.micro_batch_size", "trainer.steps",
    "trainer.prompts_per_step", "trainer.sync_bucket_mb", "trainer.keep_checkpoints",
)

_NON_NEGATIVE: tuple[str, ...] = (
    "rollout.num_cpus_per_worker", "rollout.num_gpus_per_worker", "rollout.top_k",
    "reward.num_cpus_per_worker", "reward.length_penalty", "reward.length_penalty_from",
    "algo.clip_low", "algo.clip_high", "algo.dual_clip", "algo.kl_coef", "algo.adv_eps",
    "algo.max_refill_rounds", "learner.num_cpus_per_rank", "learner.num_gpus_per_rank",
    "learner.lr", "learner.weight_decay", "learner.warmup_steps", "learner.grad_clip",
    "learner.min_lr_ratio", "trainer.save_every", "trainer.max_step_retries", "ray.num_cpus",
)


def _get(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> Config:
    """Check choices, ranges and combinations; raise ConfigError naming the key."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: expected one of {', '.join(choices)}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: must be > 0")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: must be >= 0")

    if not 2 <= cfg.data.num_candidates <= 26:
        raise ConfigError(f"data.num_candidates={cfg.data.num_candidates}: must be in 2..26")
    if cfg.reward.style == "scores" and cfg.data.num_candidates > 10:
        raise ConfigError(
            f"data.num_candidates={cfg.data.num_candidates}: reward.style=scores gives each "
            "candidate a distinct score in 1..10, so at most 10 candidates"
        )
    if cfg.data.source == "parquet" and not cfg.data.path:
        raise ConfigError("data.path: required when data.source=parquet")
    if cfg.data.source == "scenes" and cfg.data.num_candidates > SCENE_MAX_CANDIDATES:
        raise ConfigError(
            f"data.num_candidates={cfg.data.num_candidates}: scene items carry at most "
            f"{SCENE_MAX_CANDIDATES} error levels"
        )
    if cfg.data.source == "scenes" and cfg.data.path:
        raise ConfigError("data.path: only read when data.source=parquet (got source=scenes)")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature: GRPO samples, so it must be > 0")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p}: must be in (0, 1]")
    if cfg.learner.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"learner.zero_stage={cfg.learner.zero_stage}: must be 0, 1, 2 or 3")
    if cfg.algo.group_size < 2:
        raise ConfigError("algo.group_size: GRPO needs at least 2 responses per prompt")
    if 0 < cfg.algo.dual_clip <= 1:
        raise ConfigError(f"algo.dual_clip={cfg.algo.dual_clip}: must be > 1 (or 0 to disable)")
    if cfg.rollout.backend == "vllm" and cfg.rollout.num_gpus_per_worker <= 0:
        # vLLM's CPU build serves text-only models; the VLM judge needs vLLM on GPU.
        raise ConfigError("rollout.num_gpus_per_worker: rollout.backend=vllm needs GPUs (> 0)")
    if cfg.rollout.backend == "hf" and cfg.rollout.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size: only the vllm backend shards the model")
    if cfg.learner.bf16 and cfg.model.dtype != "bfloat16":
        raise ConfigError("learner.bf16: set model.dtype=bfloat16 too (learner.bf16 trains in it)")
    if cfg.trainer.resume not in ("auto", "disable") and not Path(cfg.trainer.resume).is_dir():
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: not auto, disable or a directory")
    if cfg.reward.function and ":" not in cfg.reward.function:
        raise ConfigError(f"reward.function={cfg.reward.function!r}: expected module:function")
    sequences = cfg.trainer.prompts_per_step * cfg.algo.group_size
    per_update = cfg.algo.ppo_mini_batches * cfg.learner.num_ranks * cfg.learner.micro_batch_size
    if sequences % per_update:
        # Every rank must run the same number of micro-batches (ZeRO collectives), so a step's
        # sequences must split evenly into mini-batches x ranks x micro-batches.
        raise ConfigError(
            f"trainer.prompts_per_step: {cfg.trainer.prompts_per_step} prompts x algo.group_size "
            f"{cfg.algo.group_size} = {sequences} sequences do not split into algo.ppo_mini_batches "
            f"{cfg.algo.ppo_mini_batches} x learner.num_ranks {cfg.learner.num_ranks} x "
            f"learner.micro_batch_size {cfg.learner.micro_batch_size}"
        )
    if cfg.reward.length_penalty > 0 and cfg.reward.length_penalty_from >= cfg.rollout.max_new_tokens:
        raise ConfigError("reward.length_penalty_from: must be below rollout.max_new_tokens")
    return cfg


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, validated. Returns a `Config` object."""
    try:
        merged: DictConfig = OmegaConf.structured(Config)
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
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
