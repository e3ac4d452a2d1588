"""`model.*`: the judge, its image budget and its LoRA adapters (`model.lora.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pjray.config.fields import ConfigError, opt

if TYPE_CHECKING:
    from pjray.config.rollout import RolloutConfig

# The LoRA ranks vLLM serves (its max_lora_rank takes one of them, at least the adapter's rank).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The modules vLLM serves a Qwen judge's LoRA adapter on (the language model's projections, in
# PEFT's names; vLLM maps them onto its packed qkv / gate_up layers): not lm_head, not embeddings.
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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

    def check(self) -> None:
        if self.rank and not self.target_modules:
            raise ConfigError("model.lora.target_modules: empty; name modules or use [all-linear]")


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
    # earns a reward: set algo.prefilter_zero_std=false, which would leave it nothing);
    # base_policy = the base policy (task.kind=policy: pjray.recipes.base_policy), built once.
    init: str = opt("one_disposition", choices=("base_judge", "never_shown", "one_disposition", "base_policy", "tiny"))
    # qwen2: text-only; llava_onevision, internvl, gemma3, idefics3: the other judge families.
    tiny_arch: str = opt(
        "qwen2_vl",
        choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "llava_onevision", "internvl", "gemma3", "idefics3"),
    )
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
    # checkpoint's own, lowered to max_pixels if above it. Qwen-VL judges only: the other
    # families cut an image into their processor's fixed tiles.
    min_pixels: int = opt(0, ge=0, why="0: the checkpoint's own")
    max_pixels: int = opt(1_003_520, ge=0, why="0: the checkpoint's own")
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A node-local directory: the judge's checkpoint is copied there once per node before the
    # actors load it, so a node's ranks and engines do not all read shared storage at start-up
    # (pjray.staging); a hub id is resolved to one commit and its snapshot staged alike. Empty:
    # they load `path` (or the resolved judge) directly.
    stage_dir: str = ""

    @property
    def image_budget(self) -> ImageBudget:
        return ImageBudget(self.min_pixels, self.max_pixels)

    def check(self) -> None:
        if self.max_pixels and self.min_pixels > self.max_pixels:
            raise ConfigError(f"model.min_pixels={self.min_pixels} > model.max_pixels={self.max_pixels}")
        self.lora.check()
