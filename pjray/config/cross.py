"""The checks that tie two or more sections together: one function per tie, named for it.

A tie's parameters are named after the sections it reads (`model`, `rollout`, ...), and `check`
hands each tie those sections of the config, so a tie reads only what its signature names.
`validate` runs them after every section's own `check()`, in the order of `TIES`.
"""

from __future__ import annotations

import inspect
from typing import Any

from pjray.config.algo import AlgoConfig
from pjray.config.cluster import RayConfig
from pjray.config.data import DataConfig
from pjray.config.eval import EvalConfig
from pjray.config.fields import ConfigError
from pjray.config.learner import LearnerConfig
from pjray.config.model import VLLM_LORA_MODULES, VLLM_LORA_RANKS, ModelConfig
from pjray.config.reward import RewardConfig
from pjray.config.rollout import RolloutConfig
from pjray.config.task import TaskConfig
from pjray.config.trainer import TrainerConfig


def check_lora_sync(model: ModelConfig, rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    """model.lora.sync: an adapter sync needs rollout workers of their own, reached through the
    object store, and (for vLLM) an adapter vLLM can serve."""
    lora, ro, sync = model.lora, rollout, model.lora.sync
    if sync == "auto":
        pass
    elif not lora.rank:
        raise ConfigError(f"model.lora.sync={sync}: there is no adapter without LoRA (model.lora.rank > 0)")
    elif ro.backend == "hybrid":
        raise ConfigError(
            f"model.lora.sync={sync}: rollout.backend=hybrid generates with the module it trains, "
            "so nothing is synced (leave it at auto)"
        )
    elif sync == "adapter" and ro.colocate:
        raise ConfigError(
            "model.lora.sync=adapter: colocated engines discard their weights while they sleep and take "
            "them back only with a full sync; use model.lora.sync=merged (or auto)"
        )
    elif sync == "adapter" and trainer.sync_backend not in ("auto", "object_store"):
        raise ConfigError(
            f"model.lora.sync=adapter: the adapter travels through the object store, not "
            f"trainer.sync_backend={trainer.sync_backend}; set one of them to auto"
        )
    if lora.sync_mode(ro, trainer.sync_backend) != "adapter" or ro.backend != "vllm":
        return
    why = "set model.lora.sync=merged to send merged weights instead"
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"model.lora.rank={lora.rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; {why}"
        )
    if lora.vision:
        raise ConfigError(f"model.lora.vision: vLLM serves LoRA adapters on the language model only; {why}")
    unserved = sorted(set(lora.target_modules) - {"all-linear", *VLLM_LORA_MODULES})
    if unserved:
        raise ConfigError(
            f"model.lora.target_modules: vLLM serves no LoRA adapter on {unserved} (only on "
            f"{', '.join(VLLM_LORA_MODULES)} or all-linear); {why}"
        )


def check_counterfactual_pairs(data: DataConfig, algo: AlgoConfig) -> None:
    if data.counterfactual_pairs and algo.group_size % 2:
        raise ConfigError(
            f"algo.group_size={algo.group_size}: data.counterfactual_pairs splits a group over two images (even)"
        )


def check_scores_style(reward: RewardConfig, data: DataConfig) -> None:
    if reward.style == "scores" and data.num_candidates > 10:
        raise ConfigError(
            f"data.num_candidates={data.num_candidates}: reward.style=scores gives each "
            "candidate a distinct score in 1..10, so at most 10 candidates"
        )


def check_text_only_judge(model: ModelConfig, data: DataConfig) -> None:
    if model.init == "tiny" and model.tiny_arch == "qwen2" and not model.path and data.images:
        raise ConfigError("data.images: model.tiny_arch=qwen2 is text-only, set data.images=false")


def check_hybrid(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    """The hybrid engine has no weight sync (its rollout keys: RolloutConfig.check)."""
    if rollout.backend == "hybrid" and trainer.sync_backend != "auto":
        raise ConfigError(
            f"trainer.sync_backend={trainer.sync_backend}: rollout.backend=hybrid generates with "
            "the weights it trains, so there is no weight sync (leave it at auto)"
        )


def check_colocate(rollout: RolloutConfig, learner: LearnerConfig) -> None:
    """Colocated engines: vLLM on GPUs, one per learner rank, sharing its GPU."""
    ro, lc = rollout, learner
    if not ro.colocate:
        return
    if ro.backend != "vllm" or not ro.num_gpus_per_worker > 0 or lc.num_gpus_per_rank <= 0:
        raise ConfigError(
            "rollout.colocate: needs rollout.backend=vllm on GPUs, with learner.num_gpus_per_rank "
            "and rollout.num_gpus_per_worker both > 0"
        )
    if ro.num_workers != lc.num_ranks:
        raise ConfigError(
            f"rollout.num_workers={ro.num_workers}: colocated, there is one engine per learner rank "
            f"(learner.num_ranks={lc.num_ranks})"
        )
    if lc.num_gpus_per_rank + ro.num_gpus_per_worker > 1:
        raise ConfigError(
            f"rollout.num_gpus_per_worker={ro.num_gpus_per_worker:g}: colocated, it plus "
            f"learner.num_gpus_per_rank={lc.num_gpus_per_rank:g} shares one GPU (sum <= 1)"
        )


def check_overlong_buffer(reward: RewardConfig, rollout: RolloutConfig) -> None:
    if reward.overlong_buffer > rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer={reward.overlong_buffer}: at most rollout.max_new_tokens "
            f"({rollout.max_new_tokens}), the length the penalty reaches its full value at"
        )


def check_image_contrast(algo: AlgoConfig, data: DataConfig, trainer: TrainerConfig) -> None:
    if not algo.contrast_responses:
        return
    if not data.images:
        why = "needs images (data.images)"
    elif data.counterfactual_pairs:
        why = "is not combined with data.counterfactual_pairs (a study arm of its own)"
    elif algo.contrast_image == "blank" and data.source != "scenes":
        why = "with contrast_image=blank needs data.source=scenes"
    elif algo.contrast_image == "other" and trainer.prompts_per_step < 2:
        why = "with contrast_image=other needs trainer.prompts_per_step >= 2"
    else:
        return
    raise ConfigError(f"algo.contrast_responses={algo.contrast_responses}: image contrast {why}")


def check_rollout_correction(algo: AlgoConfig, rollout: RolloutConfig) -> None:
    """A correction asked for (algo.rollout_is resolved by `validate`) needs an engine gap."""
    if algo.rollout_is != "none" and rollout.backend == "hybrid":
        raise ConfigError(
            f"algo.rollout_is={algo.rollout_is}: rollout.backend=hybrid samples with the learner's own weights, "
            "so there is no engine gap to correct; set algo.rollout_is=none"
        )


def check_bf16(learner: LearnerConfig, model: ModelConfig) -> None:
    if learner.bf16 and model.dtype != "bfloat16":
        raise ConfigError("learner.bf16: set model.dtype=bfloat16 too (learner.bf16 trains in it)")


def check_offload_during_generation(learner: LearnerConfig, rollout: RolloutConfig) -> None:
    if learner.offload_during_generation and not (rollout.colocate and learner.num_gpus_per_rank > 0):
        raise ConfigError(
            "learner.offload_during_generation: only colocated GPU ranks hand their memory to engines "
            "(rollout.colocate=true, learner.num_gpus_per_rank > 0)"
        )


def check_batch_split(trainer: TrainerConfig, algo: AlgoConfig, learner: LearnerConfig) -> None:
    """Every rank must run the same number of micro-batches (ZeRO collectives), so a step's
    sequences must split evenly into mini-batches x ranks x micro-batches."""
    t, lc = trainer, learner
    sequences = t.prompts_per_step * algo.group_size
    # Token-budget micro-batches are cut on each rank (and padded to the ranks' largest count),
    # so only fixed ones must divide the shards.
    per_micro = 1 if lc.micro_batch_tokens else lc.micro_batch_size
    if sequences % (algo.ppo_mini_batches * lc.num_ranks * per_micro):
        raise ConfigError(
            f"trainer.prompts_per_step: {t.prompts_per_step} prompts x algo.group_size "
            f"{algo.group_size} = {sequences} sequences do not split into algo.ppo_mini_batches "
            f"{algo.ppo_mini_batches} x learner.num_ranks {lc.num_ranks}"
            + ("" if lc.micro_batch_tokens else f" x learner.micro_batch_size {lc.micro_batch_size}")
        )


def check_keep_best(trainer: TrainerConfig, eval: EvalConfig) -> None:
    if trainer.keep_best and not (trainer.keep_best.startswith("eval/") and eval.every_steps):
        raise ConfigError(
            f"trainer.keep_best={trainer.keep_best}: a validation metric (eval/...) logged every "
            "eval.every_steps steps; set eval.every_steps > 0"
        )


def check_prefilter(algo: AlgoConfig, data: DataConfig) -> None:
    if algo.prefilter_zero_std and data.streaming:
        raise ConfigError(
            "algo.prefilter_zero_std: a pass over the training set needs it in memory; set data.streaming=false"
        )


def check_async(trainer: TrainerConfig, rollout: RolloutConfig, algo: AlgoConfig) -> None:
    """trainer.max_staleness > 0: rollout workers of their own that generate while the learner trains."""
    k = trainer.max_staleness
    if k == 0:
        return
    if rollout.backend == "hybrid":
        raise ConfigError(
            f"trainer.max_staleness={k}: rollout.backend=hybrid generates on the learner ranks, which cannot "
            "train at the same time; use rollout.backend=hf or vllm (workers of their own)"
        )
    if rollout.colocate:
        raise ConfigError(
            f"trainer.max_staleness={k}: colocated engines sleep while the learner trains on their GPU, "
            "so nothing overlaps; set rollout.colocate=false"
        )
    if algo.filter_zero_std:
        raise ConfigError(
            f"trainer.max_staleness={k}: algo.filter_zero_std refills a batch with items taken after the "
            "batches in flight, which a resumed run could not replay; set one of them off"
        )


def check_sync_backend(trainer: TrainerConfig, rollout: RolloutConfig, learner: LearnerConfig) -> None:
    ro, lc, sync = rollout, learner, trainer.sync_backend
    if sync == "ipc" and not ro.colocate:
        raise ConfigError("trainer.sync_backend=ipc: CUDA IPC needs rollout.colocate=true")
    if sync == "nccl" and (ro.colocate or ro.num_gpus_per_worker <= 0 or lc.num_gpus_per_rank <= 0):
        # NCCL refuses two ranks of one communicator on the same GPU.
        raise ConfigError(
            "trainer.sync_backend=nccl: needs the learner and the engines on separate GPUs "
            "(rollout.colocate=false, GPUs for both); use ipc when colocated"
        )
    if sync in ("gloo", "nccl", "ipc") and ro.backend != "vllm":
        raise ConfigError(f"trainer.sync_backend={sync}: only the vllm backend has a weight-sync group")


def check_gpus_fit(
    ray: RayConfig, rollout: RolloutConfig, learner: LearnerConfig, task: TaskConfig, reward: RewardConfig
) -> None:
    """The GPUs the layout needs (with a policy's judge engines on GPUs of their own) fit in ray.num_gpus."""
    ro, lc, judge = rollout, learner, reward.judge
    if ray.num_gpus <= 0:
        return
    if ro.colocate:
        needed = f"{lc.num_ranks} GPUs (one per colocated learner rank and engine)"
        total = float(lc.num_ranks)
    else:
        learner_gpus = lc.num_ranks * lc.num_gpus_per_rank
        rollout_gpus = ro.num_workers * ro.num_gpus_per_worker
        needed = f"{learner_gpus:g} learner + {rollout_gpus:g} rollout GPUs"
        total = learner_gpus + rollout_gpus
    if task.kind == "policy" and reward.source != "rule" and not judge.colocate and judge.num_gpus_per_worker:
        judge_gpus = judge.num_workers * judge.num_gpus_per_worker
        needed += f" + {judge_gpus:g} judge GPUs"
        total += judge_gpus
    if total > ray.num_gpus:
        raise ConfigError(f"ray.num_gpus={ray.num_gpus}: the layout needs {needed}")


def check_held_out_seed(eval: EvalConfig, data: DataConfig) -> None:
    """The held-out eval must not judge the scenes the policy trains on."""
    if (
        eval.every_steps
        and eval.train_bench == "perceptual_bias"
        and data.source == "scenes"
        and eval.train_seed == data.seed
    ):
        raise ConfigError(f"eval.train_seed={eval.train_seed}: must differ from data.seed for a held-out eval")


def check_judge_task(task: TaskConfig, reward: RewardConfig, data: DataConfig, model: ModelConfig) -> None:
    """A judge's training reads none of the policy's reward keys, nor a reference answer column,
    and does not start from the base policy."""
    if task.kind == "judge" and not model.path and model.init == "base_policy":
        raise ConfigError("model.init=base_policy: a policy to train (task.kind=policy), not a judge")
    if task.kind == "judge" and "answer" in data.columns:
        raise ConfigError("data.columns.answer: a policy's reference answer, only read when task.kind=policy")
    if task.kind == "judge":
        defaults = RewardConfig()
        for key in ("source", "judge_weight", "judge"):
            if getattr(reward, key) != getattr(defaults, key):
                raise ConfigError(f"reward.{key}: only read when task.kind=policy (a policy's reward)")


# Judge-training features a policy's run has no use for: their key and why.
_JUDGE_ONLY = (
    ("data.counterfactual_pairs", lambda c: c["data"].counterfactual_pairs, "swaps a PPJD tuple's image"),
    ("algo.contrast_responses", lambda c: c["algo"].contrast_responses, "rewards a judge's use of the image"),
    ("reward.shuffle_target", lambda c: c["reward"].shuffle_target, "shuffles a ranking target"),
    ("reward.function", lambda c: bool(c["reward"].function), "replaces the judge's ranking reward"),
    ("data.streaming", lambda c: c["data"].streaming, "streams PPJD tuples"),
    ("eval.every_steps", lambda c: bool(c["eval"].every_steps), "evaluates a judge"),
)


def check_policy_task(
    task: TaskConfig,
    data: DataConfig,
    algo: AlgoConfig,
    reward: RewardConfig,
    trainer: TrainerConfig,
    rollout: RolloutConfig,
    eval: EvalConfig,
) -> None:
    """task.kind=policy: rows of (image, question[, answer]), no judge-only feature, and a judge
    reward whose call design fits the group and the step's cap."""
    if task.kind != "policy":
        return
    sections = {"data": data, "algo": algo, "reward": reward, "eval": eval}
    for key, is_set, why in _JUDGE_ONLY:
        if is_set(sections):
            raise ConfigError(f"{key}: not with task.kind=policy (it {why})")
    if data.source == "parquet":
        raise ConfigError(
            "data.source=parquet reads PPJD tuples; a policy reads (image, question, answer) rows: "
            "data.source=scenes, or hf (a dataset, or a folder of JSONL or parquet files)"
        )
    if reward.source == "rule":
        return
    judge = reward.judge
    if judge.subset_size > algo.group_size:
        raise ConfigError(
            f"algo.group_size={algo.group_size}: reward.judge.protocol={judge.protocol} shows "
            f"{judge.subset_size} answers of a group a call"
        )
    calls = trainer.prompts_per_step * judge.calls_per_group(algo.group_size)
    if judge.max_calls_per_step and calls > judge.max_calls_per_step:
        raise ConfigError(
            f"reward.judge.max_calls_per_step={judge.max_calls_per_step}: a step needs {calls} judge calls "
            f"(trainer.prompts_per_step x reward.judge.rounds x the group's subsets x their K rotations); lower rounds or raise the cap"
        )
    if judge.colocate and (rollout.backend == "hybrid" or judge.num_workers > rollout.num_workers):
        raise ConfigError(
            "reward.judge.colocate: judge worker i shares rollout worker i's bundle: needs rollout workers "
            f"(rollout.backend hf or vllm) and reward.judge.num_workers <= rollout.num_workers={rollout.num_workers}"
        )


TIES = (
    check_judge_task,
    check_policy_task,
    check_lora_sync,
    check_counterfactual_pairs,
    check_scores_style,
    check_text_only_judge,
    check_hybrid,
    check_colocate,
    check_overlong_buffer,
    check_image_contrast,
    check_rollout_correction,
    check_bf16,
    check_offload_during_generation,
    check_batch_split,
    check_keep_best,
    check_prefilter,
    check_async,
    check_sync_backend,
    check_gpus_fit,
    check_held_out_seed,
)


def check(cfg: Any) -> None:
    """Every tie, each handed the sections of `cfg` (a `pjray.config.root.Config`; not imported
    here, which would be a cycle) that its parameters name."""
    for tie in TIES:
        tie(*(getattr(cfg, name) for name in inspect.signature(tie).parameters))
