"""`data.*`: the training rows, and the scene names and checks that `ppjd.*` and `eval.*` share.

The scene world's names (`KINDS`, `SPLITS`, `CONSTRUCTIONS`) are defined here, where the config
checks values against them, so loading a config imports no domain code; pjray.data.scenes and
pjray.ppjd.perturb import them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pjray.config.fields import ConfigError, opt

# The question kinds of scene items (pjray.data.scenes builds and answers them).
KINDS: tuple[str, ...] = ("color", "count", "spatial", "size", "existence")
# The content splits of scenes (pjray.data.scenes.in_split): train, held_out (evaluation
# content: held-out (shape, cell) combinations), or all.
SPLITS: tuple[str, ...] = ("train", "held_out", "all")
# How the wrong candidates of a scene row are built (pjray.ppjd.perturb.construct_levels).
CONSTRUCTIONS: tuple[str, ...] = ("nested", "independent")

# The rules rewriters build at most this many strictly ordered error levels: scene answers have
# few enough facts (pjray.ppjd.perturb.MAX_CANDIDATES), free-text answers are held to the same
# bound. Kept here so loading a config never imports torch.
SCENE_MAX_CANDIDATES = 6

# The fields `data.columns` may map to a dataset's columns (pjray.data.hf): the PPJD columns, or
# chosen/rejected for a preference-pair dataset (K = 2 tuples); a policy's rows (task.kind=policy):
# id, image, question and answer (the reference, optional).
DATA_COLUMNS = ("id", "image", "question", "candidates", "order", "source", "meta", "chosen", "rejected", "answer")

# Distinct wrong final answers a question kind can carry (the independent construction needs
# K - 1): spatial and existence answers have two values, a size answer three; a count question
# depends on its scene (rows it cannot carry are rejected with the reason).
_WRONG_ANSWERS = {"spatial": 1, "existence": 1, "size": 2}


def check_scenes(section: str, kinds: list[str], objects: list[int]) -> None:
    """`<section>.scene_kinds` and `<section>.scene_objects` (data, ppjd, eval)."""
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ConfigError(f"{section}.scene_kinds={list(kinds)}: must be a non-empty list of {list(KINDS)}")
    if len(objects) != 2 or not 1 <= objects[0] <= objects[1] <= 9:
        raise ConfigError(f"{section}.scene_objects={list(objects)}: must be [min, max] with 1 <= min <= max <= 9")
    if "spatial" in kinds and objects[0] < 2:
        raise ConfigError(f"{section}.scene_objects={list(objects)}: spatial questions need at least 2 objects")


def check_construction(section: str, construction: str, kinds: Sequence[str], num_candidates: int) -> None:
    """`<section>.construction=independent`: every scene kind carries K - 1 wrong answers (data, ppjd)."""
    if construction != "independent":
        return
    short = [k for k in kinds if _WRONG_ANSWERS.get(k, num_candidates) < num_candidates - 1]
    if short:
        raise ConfigError(
            f"{section}.construction=independent: {section}.scene_kinds {short} cannot carry "
            f"{num_candidates - 1} wrong answers that differ ({section}.num_candidates={num_candidates}); "
            "leave them out or use construction=nested"
        )


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

    def check(self) -> None:
        if self.source == "scenes":
            check_construction("data", self.construction, self.scene_kinds, self.num_candidates)
        if self.counterfactual_pairs and (self.source != "scenes" or not set(self.scene_kinds) <= {"color", "size"}):
            raise ConfigError(
                f"data.counterfactual_pairs: needs data.source=scenes with data.scene_kinds of color and "
                f"size (the image swap re-renders those), not {self.source} {list(self.scene_kinds)}"
            )
        if self.source in ("parquet", "hf") and not self.path:
            raise ConfigError(f"data.path: required when data.source={self.source}")
        self._check_hf()
        check_scenes("data", self.scene_kinds, self.scene_objects)
        if self.source == "scenes" and self.num_candidates > SCENE_MAX_CANDIDATES:
            raise ConfigError(
                f"data.num_candidates={self.num_candidates}: scene items carry at most "
                f"{SCENE_MAX_CANDIDATES} error levels"
            )
        if self.source == "scenes" and self.path:
            raise ConfigError("data.path: only read when data.source is parquet or hf (got source=scenes)")

    def _check_hf(self) -> None:
        """The keys only data.source=hf reads are left at their defaults otherwise."""
        if self.source != "hf":
            defaults = DataConfig()
            for key in ("split", "subset", "revision", "columns", "streaming"):
                if getattr(self, key) != getattr(defaults, key):
                    raise ConfigError(f"data.{key}: only read when data.source=hf (got source={self.source})")
        unknown = sorted(set(self.columns) - set(DATA_COLUMNS))
        if unknown:
            raise ConfigError(f"data.columns.{unknown[0]}: not a field; expected one of {', '.join(DATA_COLUMNS)}")
        empty = [f for f, column in self.columns.items() if not column]
        if empty:
            raise ConfigError(f"data.columns.{empty[0]}: empty column name")
        if not self.split:
            raise ConfigError("data.split: empty; name the split to train on (e.g. train)")
