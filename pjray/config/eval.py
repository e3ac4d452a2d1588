"""`eval.*`: `pjray eval` on the judge benchmarks, and the trainer's held-out eval."""

from __future__ import annotations

from dataclasses import dataclass, field

from pjray.config.data import KINDS, SPLITS, check_scenes
from pjray.config.fields import ConfigError, opt

# eval.* options of the strict convention: the other conventions leave them at their defaults.
_STRICT_ONLY = ("seed_agg", "tie_rule", "pair_vote", "unparsed_score", "prompt_format", "batch_style", "score_mapping")
_ROW_BENCHES = ("score", "pair", "batch", "vl_rewardbench", "mm_rewardbench")  # rows of their own, from eval.data
_PREFERENCE_BENCHES = ("vl_rewardbench", "mm_rewardbench")


def is_outputs_file(name: str) -> bool:
    """An `eval.compare` entry (or `eval.outputs`) that names judge outputs, a .jsonl file, not a judge."""
    return name.endswith(".jsonl")


@dataclass(frozen=True)
class EvalConfig:
    """`pjray eval`, and the held-out eval the trainer runs every `every_steps` steps."""

    # HF directory (a pjray export such as <run_dir>/hf_model, or a base model) or hub id.
    judge: str = ""
    # score | pair | batch (MLLM-as-a-Judge) | perceptual_bias (Mode a/b) | mm_judgebias | looking
    # (does it look: image-following on held-out scene tuples, pjray.eval.looking; the base judges'
    # scenes: configs/eval_looking.yaml) | vl_rewardbench | mm_rewardbench (the pairwise
    # preference benchmarks, scored as their official scripts do: pjray.eval.reward_bench)
    bench: str = opt(
        "perceptual_bias",
        choices=(
            "score",
            "pair",
            "batch",
            "perceptual_bias",
            "mm_judgebias",
            "looking",
            "vl_rewardbench",
            "mm_rewardbench",
        ),
    )
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

    def check(self) -> None:
        """The benchmark's data, its convention's keys, the blind passes, the looking bench."""
        check_scenes("eval", self.scene_kinds, self.scene_objects)
        if not self.seeds:
            raise ConfigError("eval.seeds: at least one seed")
        if self.bench in _ROW_BENCHES and not self.data:
            raise ConfigError(
                f"eval.data: required for eval.bench={self.bench} (the published rows: a file, a folder or a hub id)"
            )
        if self.prompt_format == "original" and self.score_mapping == "ceil_half":
            raise ConfigError("eval.score_mapping=ceil_half: the original prompt already scores 1-5; use auto or none")
        if self.convention != "strict":
            self._check_convention()
        for mode in self.blind:
            if mode not in ("grey", "none", "mismatched"):
                raise ConfigError(
                    f"eval.blind={list(self.blind)}: {mode!r} is not a blind mode; expected grey, none or mismatched"
                )
            if (
                mode == "mismatched"
                and self.bench not in _ROW_BENCHES
                and not (self.every_steps and self.train_bench in _PREFERENCE_BENCHES)
            ):
                raise ConfigError(
                    f"eval.blind=mismatched: only for eval.bench={', '.join(_ROW_BENCHES)} or a training "
                    f"validation on a preference benchmark (rows to swap images between), not {self.bench}"
                )
        self._check_preference()
        if len(set(self.blind)) < len(self.blind) or self.image in self.blind:
            raise ConfigError(
                f"eval.blind={list(self.blind)}: each mode once, and not eval.image={self.image} (the main pass)"
            )
        if self.bench == "looking":
            self._check_looking()
        if self.bias_convention != "official" and self.bench != "mm_judgebias":
            raise ConfigError(f"eval.bias_convention={self.bias_convention}: only for eval.bench=mm_judgebias")
        if self.num_cpus_per_worker <= 0 and self.num_gpus_per_worker <= 0:
            raise ConfigError("eval.num_cpus_per_worker: a judge worker needs CPUs or GPUs (> 0)")

    def _check_convention(self) -> None:
        """A release's convention (not strict): its benchmarks, and the strict options left alone."""
        if self.bench not in ("score", "pair", "batch"):
            raise ConfigError(f"eval.convention={self.convention}: only for eval.bench=score, pair or batch")
        # The release scripts read the paper prompt's answers and fix their own rules.
        defaults = EvalConfig()
        for key in _STRICT_ONLY:
            value, default = getattr(self, key), getattr(defaults, key)
            if value != default and (key, value) != ("prompt_format", "paper"):  # auto is paper here
                raise ConfigError(
                    f"eval.{key}={value!r}: only read with eval.convention=strict; "
                    f"eval.convention={self.convention} follows its script's own rule (leave it at {default!r})"
                )

    def _check_looking(self) -> None:
        # pjray.eval.looking: its own images (original, swapped, blank) of held-out scene tuples.
        if self.data or self.image != "as_is" or self.blind:
            raise ConfigError(
                "eval.bench=looking: judges its own scene tuples and images (swapped, blank); "
                "leave eval.data, eval.image and eval.blind unset"
            )
        if not set(self.scene_kinds) <= {"color", "size"}:
            raise ConfigError(f"eval.scene_kinds={list(self.scene_kinds)}: the looking bench swaps color or size only")
        if self.num_items % (6 * len(self.scene_kinds)):
            raise ConfigError(
                f"eval.num_items={self.num_items}: the looking bench needs a multiple of "
                f"{6 * len(self.scene_kinds)} (3! letter orders for each of eval.scene_kinds), e.g. 120"
            )

    def _check_preference(self) -> None:
        """The keys of the preference benchmarks (pjray.eval.reward_bench)."""
        if self.bench not in _PREFERENCE_BENCHES:
            for key in ("outputs", "compare"):
                if getattr(self, key):
                    raise ConfigError(
                        f"eval.{key}: only for eval.bench=vl_rewardbench or mm_rewardbench, not {self.bench}"
                    )
        if self.both_orders and self.bench != "mm_rewardbench":
            raise ConfigError("eval.both_orders: only for mm_rewardbench (VL-RewardBench draws the order per sample)")
        if self.outputs:
            if self.judge:
                raise ConfigError(
                    f"eval.outputs={self.outputs}: scores outputs made elsewhere; leave eval.judge empty "
                    f"(got {self.judge})"
                )
            if self.blind or self.both_orders:
                raise ConfigError(
                    "eval.outputs: the file holds one pass; eval.blind and eval.both_orders judge more, "
                    "so they take a judge"
                )
            if not is_outputs_file(self.outputs):
                raise ConfigError(f"eval.outputs={self.outputs}: a .jsonl file of judge outputs")
        for name in self.compare:
            if (self.blind or self.both_orders) and is_outputs_file(name):
                raise ConfigError(f"eval.compare: {name} holds one pass; eval.blind and eval.both_orders judge more")
        if self.compare and not (self.judge or self.outputs):
            raise ConfigError("eval.compare: compares with eval.judge or eval.outputs; name one of them")
        if self.train_bench in _PREFERENCE_BENCHES and self.every_steps and not self.data:
            raise ConfigError(f"eval.data: required for eval.train_bench={self.train_bench} (the benchmark's rows)")
