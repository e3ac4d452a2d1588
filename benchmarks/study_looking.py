"""Does GRPO teach a judge to look at the image? The looking study.

    python benchmarks/study_looking.py                  # 5 seeds, 160 steps, curves at 10, 20, 40, 80, 160
    python benchmarks/study_looking.py --seeds 0,1 --steps 40 --bases never_shown
    python benchmarks/study_looking.py --smoke          # every stage on a few items and steps (`pytest -m extended`)

Declared before any run (keep this section as written; results that disagree are reported, not
re-declared):

**Primary outcome**: held-out image-following per question kind (`pjray.eval.looking`:
independent K = 3 tuples of the held-out content split, letters balanced, greedy; the correct
answer first on the original image AND the perception-error answer first on the swapped one)
of the GRPO judges trained from the **never-shown base judge** (`model.init=never_shown`: every
supervised verdict by the text, so it has no look mode to switch on), at their last step. A
variant teaches that judge to look when, on both kinds, the lower end of the 95% t-interval over
its seeds' means lies above 1/(K-1)^2 = 25%, the image-following of a judge that drops the
self-contradicting answer and guesses per image.

**Secondary**: the same for the shipped base judge (`model.init=base_judge`), beside its forced
ceiling (its "Verdict: by the image." disposition forced, its own "Image: X." kept: what one
token of a built-in switch reaches); per judge the disposition rate, correct first, the blank
control's correct first (the scene without its object) and its paired change from the base
judge; at every step of the curve the greedy and the sampled (temperature 1, 4 samples) held-out
reward beside the training reward of the steps before it; the hierarchical bootstrap beside the
t-interval; the permutation null beside the fixed ones. (Since 2026-12-06 the paired swap test, exact
McNemar on the perception-error answer first on the original vs the swapped image per item, stands
where the permutation null stood: that null tested another question. Each row also carries the
paired test against the forced base judge, and the blank change is taken against the forced base
judge's blank verdicts.)

**The one-disposition study** (declared 2026-12-06, before its first run finished): from the base
judge of one disposition (`model.init=one_disposition`: no disposition sentence, its checks of
orange and purple never taught), at 40 steps. Primary: held-out image-following on the
**untaught** part (the colour tuples whose original or swapped image shows orange or purple),
trained minus the base judge on the same items, per seed: the plain arm
(`independent_levenshtein`) teaches it when the lower end of the 95% t-interval over its seeds
lies above +20 points; the shuffled-target control's interval includes 0. Secondary: the taught
part not down by more than 10 points; the sampled training reward, mean of the last 5 steps minus
the first 5, at least +0.1; the image-contrast and counterfactual-pairs arms beside the plain one
at the same samples a prompt. (Amended the same day: the first build leaves orange and purple
untaught, where a right first place under the Kendall reward the pilots chose can raise the
sampled reward by about +0.11 at most, so a rebuild with yellow untaught too was declared before
any of its runs, to make the +0.1 reachable. Its first runs (seed 0: the plain arm at lr 1e-4 and 2e-4, the shuffled control)
taught the untaught part too slowly (13% -> 33% and 43%, the taught part down 23 points at 2e-4),
so the rebuild was dropped and the study completed every arm at 5 seeds from the first build, at
the code of its first runs; benchmarks/results/README.md gives both. The plain arm is
`independent_kendall`.) (Amended again the same day, before the runs it adds: its arms rerun at 5
seeds with `--prefilter` (`algo.prefilter_zero_std`: before step 1 each run leaves out the items
whose group, sampled by the base judge, earns one reward in every response) at lr 5e-5, the
setting two pilots at seed 0 chose (lr 1e-4: sampled reward +0.162, untaught 24% -> 82%, taught
colour down 18 points; lr 5e-5: +0.151, 89%, down 5), to lift the reward rise short of +0.1
without the prefilter. Seed 0 is one of the five; the same outcomes and thresholds apply.)

Variants (each from each base judge, the default run's budget otherwise: prompts per step, group
size, training items, learning rate; `data.seed=0`; seeds are `trainer.seed`):

| variant | data (train content split, K = 3) | reward |
|---|---|---|
| nested_levenshtein | PPJD tuples, nested construction (the paper) | batch ranking, Levenshtein (the paper) |
| independent_levenshtein | PPJD tuples, independent construction | Levenshtein |
| counterfactual_levenshtein | the independent tuples, each group half on the tuple's image and half on its swapped image (`data.counterfactual_pairs`; the same samples a step) | Levenshtein |

Every run is the whole system (`pjray.recipes.training` then `pjray.rl.trainer.train`: Ray Data PPJD build, DeepSpeed learner
that generates with the weights it trains, reward pool, HF exports at the curve's steps). A run
directory is reused only when its `study_run.json` names the same key: base judge (by the hash of
its weights), variant, seed, budget and pjray's code (`pjray.cache.code_hash`), so no run of
older code is ever reused; a started run of the same key resumes from its checkpoint.

Evaluation: one set of held-out tuples (`LOOKING_SEED`, `LETTERS_SEED`), asserted by content
(every image shown: original, swapped, blank) to share nothing with either base judge's training
items nor any run's. Intervals: 95% t-intervals on the seed means (scipy), and the hierarchical
bootstrap (seeds, then items, with replacement). Per-item verdicts of every judge go to
`looking_study_items.parquet`.

Writes looking_study.{json,md,png} and looking_study_items.parquet into benchmarks/results (or
--out DIR; --name another stem).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from scipy import stats

from pjray.cache import code_hash
from pjray.config import Config, load
from pjray.data.sources import read_items
from pjray.eval.bias import diagnosis_item, item_prompts, read_judge_score
from pjray.eval.held_out import (
    LETTERS_SEED,
    LOOKING_SEED,
    _engine,
    assert_held_out,
    parts,
    ranking_summary,
    training_items,
)
from pjray.eval.looking import (
    DISPOSITION_STEM,
    K,
    LookingItem,
    LookingVerdict,
    balanced_letters,
    blank_change,
    ceiling_test,
    follows_image,
    held_out_tuples,
    judge_looking,
    looking_items,
    nulls,
    swap_test,
)
from pjray.models.base_judge import BaseJudgeRecipe
from pjray.recipes.base_judge import RECIPES, base_judge, weights_sha256

VARIANTS: dict[str, list[str]] = {
    "nested_levenshtein": ["data.construction=nested", "reward.metric=levenshtein"],
    "independent_levenshtein": ["data.construction=independent", "reward.metric=levenshtein"],
    "counterfactual_levenshtein": [
        "data.construction=independent",
        "data.counterfactual_pairs=true",
        "reward.metric=levenshtein",
    ],
    # The one-disposition study's arms (Kendall: the released code's reward, which pays a right
    # first place when the other two are swapped; see its declaration).
    "independent_kendall": ["data.construction=independent", "reward.metric=kendall"],
    "counterfactual_kendall": [
        "data.construction=independent",
        "data.counterfactual_pairs=true",
        "reward.metric=kendall",
    ],
    # The control: each prompt's target shuffled (the reward pays for nothing shown).
    "shuffled_target": ["data.construction=independent", "reward.metric=kendall", "reward.shuffle_target=true"],
    # The image-contrast term: a quarter of each group's samples on another prompt's image
    # (`contrast_overrides`: the same samples a prompt as the other variants).
    "image_contrast": ["data.construction=independent", "reward.metric=kendall", "algo.contrast_image=other"],
}
BASES = ("never_shown", "base_judge", "one_disposition")
# A base judge's runs beyond the default: one_disposition's untaught part is colour, so its runs
# train on colour questions (size, all taught, is judged on the held-out tuples as before).
BASE_OVERRIDES = {"one_disposition": ["data.scene_kinds=[color]"]}
PARTS = ("all", "taught", "untaught")  # the items of every value, and of the recipe's taught and untaught values
PRIMARY_BASE = "never_shown"
DECLARATION = (
    f"held-out image-following per kind of the GRPO judges from {PRIMARY_BASE}, at their last step: a variant "
    "teaches that judge to look when, on both kinds, the lower end of the 95% t-interval over its seeds' means "
    "lies above 1/(K-1)^2 = 25%"
)
KINDS = ("color", "size")
METRICS = ("image_following", "correct_first", "blind_correct_first", "disposition_image")
# The score protocol on the same tuples (not forced): the disposition's rate there, and the error
# score(perception-error answer) >= score(correct answer) (nan where a score is unreadable).
SCORE_METRICS = ("disposition_score", "score_error")
TRAIN_DATA_SEED = 0
SAMPLES = 4  # sampled held-out reward: responses a prompt at temperature 1


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    curve: tuple[int, ...]  # the steps judged (the last is `steps`)
    prompts_per_step: int
    group_size: int
    train_items: int
    lr: float
    per_kind: int  # held-out tuples a kind
    seeds: tuple[int, ...]
    bootstrap: int = 2000
    prefilter: bool = (
        False  # algo.prefilter_zero_std: train on the items the base judge's groups do not all score alike
    )


def budget(steps: int, seeds: tuple[int, ...], per_kind: int = 60, curve: tuple[int, ...] | None = None) -> Budget:
    """The default run's prompts, group size, items and lr (configs/demo.yaml), run for `steps`,
    judged at `curve` (default 10, 20, 40, ... up to `steps`; `steps` is always judged)."""
    cfg = load(None, [])
    curve = tuple(s for s in ((10, 20, 40, 80, 160, 320) if curve is None else curve) if s < steps) + (steps,)
    return Budget(
        steps,
        curve,
        cfg.trainer.prompts_per_step,
        cfg.algo.group_size,
        cfg.data.num_items,
        cfg.learner.lr,
        per_kind,
        seeds,
    )


SMOKE = Budget(
    steps=2,
    curve=(1, 2),
    prompts_per_step=4,
    group_size=4,
    train_items=8,
    lr=3e-4,
    per_kind=6,
    seeds=(0,),
    bootstrap=200,
)


# --------------------------------------------------------------------------- runs


def grpo_config(base: str, variant: str, seed: int, b: Budget, run_dir: Path, judge: Path) -> Config:
    recipe = RECIPES[base]
    overrides = [
        f"data.scene_kinds=[{','.join(recipe.kinds)}]",
        *BASE_OVERRIDES.get(base, ()),
        f"data.scene_objects=[{recipe.objects[0]},{recipe.objects[1]}]",
        "data.scene_split=train",
        f"model.path={judge}",
        f"trainer.run_dir={run_dir}",
        f"trainer.seed={seed}",
        f"trainer.steps={b.steps}",
        f"trainer.prompts_per_step={b.prompts_per_step}",
        f"algo.group_size={b.group_size}",
        f"data.num_items={b.train_items}",
        f"learner.lr={b.lr}",
        f"data.seed={TRAIN_DATA_SEED}",
        "tracking.wandb=false",
        "trainer.save_every=0",
        f"trainer.export_steps=[{','.join(str(s) for s in b.curve[:-1])}]",
        *VARIANTS[variant],
        *(contrast_overrides(b) if variant == "image_contrast" else ()),
        f"algo.prefilter_zero_std={str(b.prefilter).lower()}",
    ]
    return load(None, overrides)


def contrast_overrides(b: Budget) -> list[str]:
    """A group of the image-contrast variant: a quarter of the budget's samples a prompt on the
    contrast image, the rest trained, so every variant draws the same samples a step."""
    contrast = max(1, b.group_size // 4)
    # The learner's micro-batches must split the step's trained sequences (the smoke's 4 x 3).
    sequences, micro = b.prompts_per_step * (b.group_size - contrast), load(None, []).learner.micro_batch_size
    fit = [] if sequences % micro == 0 else [f"learner.micro_batch_size={math.gcd(sequences, micro)}"]
    return [f"algo.group_size={b.group_size - contrast}", f"algo.contrast_responses={contrast}", *fit]


def run_key(judge_id: str, base: str, variant: str, seed: int, b: Budget) -> dict[str, Any]:
    """What decides a run's judges: a run directory of another key is never reused."""
    train = {
        k: getattr(b, k) for k in ("steps", "curve", "prompts_per_step", "group_size", "train_items", "lr", "prefilter")
    }
    key = {
        "base": base,
        "base_weights": judge_id,
        "variant": variant,
        "seed": seed,
        "budget": train,
        "overrides": [*VARIANTS[variant], *BASE_OVERRIDES.get(base, ())],
        "code": code_hash(),
    }
    return json.loads(json.dumps(key))  # as its marker file holds it (tuples read back as lists)


def ensure_run(run_dir: Path, key: dict[str, Any], cfg: Config, held_out: Any = None) -> tuple[float, bool]:
    """Train into `run_dir` unless it holds a finished run of `key`; returns (training seconds,
    reused). A started run of the same key resumes; one of another key is deleted. `held_out`:
    the trainer's held-out hook (`pjray train`'s check at the end of the run)."""
    from pjray.recipes.training import training_inputs
    from pjray.rl.trainer import train

    marker = run_dir / "study_run.json"
    recorded = json.loads(marker.read_text()) if marker.exists() else None
    if recorded is not None and recorded["key"] == key and (run_dir / "hf_model" / "COMPLETE").exists():
        return recorded["train_seconds"], True
    if recorded is None or recorded["key"] != key:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        marker.write_text(json.dumps({"key": key, "train_seconds": None}, indent=2))
    t0 = time.perf_counter()
    train(cfg, training_inputs(cfg), held_out=held_out)
    seconds = time.perf_counter() - t0
    (run_dir / "hf_model" / "COMPLETE").touch()  # the last export is whole
    marker.write_text(json.dumps({"key": key, "train_seconds": seconds}, indent=2))
    return seconds, False


def finished(run_dir: Path, key: dict[str, Any]) -> bool:
    """Whether `run_dir` holds a finished run of `key` (what `ensure_run` reuses)."""
    marker = run_dir / "study_run.json"
    return (
        marker.exists()
        and json.loads(marker.read_text())["key"] == key
        and (run_dir / "hf_model" / "COMPLETE").exists()
    )


def judge_at(run_dir: Path, step: int, b: Budget) -> Path:
    return run_dir / ("hf_model" if step == b.steps else f"hf_model_step_{step}")


def train_reward(run_dir: Path, step: int, window: int = 5) -> float:
    """The mean training reward (sampled, temperature 1) of the `window` steps up to `step`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    near = [r["reward/mean"] for r in rows if step - window < r["step"] <= step]
    return round(float(np.mean(near)), 4)


def reward_curve(run_dir: Path, window: int = 5) -> dict[str, float]:
    """What a user watching the run sees: the sampled training reward (its ranking part, without
    the image-contrast bonus, so variants compare) of the first and the last `window` steps, their
    difference, and the fraction of groups with all-equal rewards over the run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = rows[:window], rows[-window:]

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return float(np.mean([r[key] for r in rs]))

    out = {
        "reward_first": mean(first, "reward/mean"),
        "reward_last": mean(last, "reward/mean"),
        "ranking_first": mean(first, "reward/ranking_mean"),
        "ranking_last": mean(last, "reward/ranking_mean"),
        "frac_zero_std": mean(rows, "rollout/frac_zero_std"),
    }
    out["reward_rise"], out["ranking_rise"] = (
        out["reward_last"] - out["reward_first"],
        out["ranking_last"] - out["ranking_first"],
    )
    return {k: round(v, 4) for k, v in out.items()}


# --------------------------------------------------------------------------- judging


def evaluate(
    path: Path, items: list[LookingItem], forced: bool, recipe: BaseJudgeRecipe
) -> tuple[list[LookingVerdict], dict[str, float], dict[str, np.ndarray]]:
    """Greedy verdicts on every item's three images (and forced, if asked: for a base judge of
    one disposition, run from its own statement), the greedy and sampled held-out batch-ranking
    reward on the original images, and per item the score protocol's `SCORE_METRICS` on the
    original image."""
    greedy = _engine(str(path), top_k=1)
    verdicts, texts = judge_looking(
        lambda ps: [c.text for c in greedy.generate(ps, 1, seed=0)], items, forced, recipe.forced_sentence
    )
    diag = [diagnosis_item(it.pair.original) for it in items]  # score(correct), score(perception error)
    scored = [c.text for c in greedy.generate([p for d in diag for p in item_prompts(d)[:2]], 1, seed=0)]
    scores = [read_judge_score(t) for t in scored]
    score = {
        "disposition_score": np.array(
            [np.mean([DISPOSITION_STEM + " image" in t for t in scored[2 * i : 2 * i + 2]]) for i in range(len(diag))]
        ),
        "score_error": np.array(
            [np.nan if None in (c, w) else float(w >= c) for c, w in zip(scores[0::2], scores[1::2])]
        ),
    }
    originals = [it.pair.original for it in items]
    prompts = [it.prompts()[0] for it in items]
    sampled = _engine(str(path), temperature=1.0)
    sampled_texts = [c.text for c in sampled.generate(prompts, SAMPLES, seed=0)]
    return (
        verdicts,
        {
            "reward_greedy": ranking_summary(originals, prompts, texts, 1, recipe)["reward"],
            "reward_sampled": ranking_summary(originals, prompts, sampled_texts, SAMPLES, recipe)["reward"],
        },
        score,
    )


def per_item(verdicts: list[LookingVerdict], forced: bool) -> dict[str, np.ndarray]:
    """Each metric of `METRICS`, 0/1 per item."""
    hits = [follows_image(v, forced) for v in verdicts]
    blank = [(v.forced_blank if forced else v.top_blank) == v.best for v in verdicts]
    return {
        "image_following": np.array([a and b for a, b in hits], dtype=float),
        "correct_first": np.array([a for a, _ in hits], dtype=float),
        "blind_correct_first": np.array(blank, dtype=float),
        "disposition_image": np.array([forced or v.by_image_original for v in verdicts], dtype=float),
    }


# --------------------------------------------------------------------------- statistics


def t_interval(values: list[float]) -> dict[str, float | None]:
    """Mean of the seed means with its 95% t-interval (None with one seed)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return {"mean": float(x.mean()), "lo": None, "hi": None}
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return {"mean": float(x.mean()), "lo": float(x.mean() - half), "hi": float(x.mean() + half)}


def hierarchical_bootstrap(values: np.ndarray, reps: int, seed: int = 1) -> dict[str, float]:
    """Mean of `values` [seeds, items] with a 95% percentile interval: each replicate draws seeds
    with replacement, then items with replacement."""
    values = np.atleast_2d(values)
    n_seeds, n_items = values.shape
    rng = np.random.default_rng(seed)
    items = rng.integers(0, n_items, size=(reps, n_items))
    seeds = rng.integers(0, n_seeds, size=(reps, n_seeds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a draw of only undefined items: nan, dropped
        dist = np.nanmean(values[seeds[:, :, None], items[:, None, :]], axis=(1, 2))
    lo, hi = np.percentile(dist[~np.isnan(dist)], [2.5, 97.5])
    return {"mean": float(np.nanmean(values)), "lo": float(lo), "hi": float(hi)}


# --------------------------------------------------------------------------- the study


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="every stage on a few items and steps (a test, not a study)")
    ap.add_argument(
        "--steps", type=int, default=160, help="GRPO steps a run (the curve is judged at 10, 20, 40, ... up to it)"
    )
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated GRPO seeds")
    ap.add_argument("--final-only", action="store_true", help="judge each run at its last step only (no curve)")
    ap.add_argument("--lr", type=float, default=None, help="the learner's lr (default: the default run's)")
    ap.add_argument("--prefilter", action="store_true", help="every run with algo.prefilter_zero_std=true")
    ap.add_argument(
        "--finished-only", action="store_true", help="judge only the runs already finished with their key, train none"
    )
    ap.add_argument(
        "--train-only", action="store_true", help="train (or reuse) the runs and stop: a later invocation judges them"
    )
    ap.add_argument("--bases", default=",".join(BASES), help="comma-separated base judges: " + ",".join(BASES))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results", help="where <name>.{json,md,png} go")
    ap.add_argument("--name", default="looking_study", help="the output files' stem")
    ap.add_argument(
        "--work", default="runs/looking_study", help="run directories (reused when finished with the same key)"
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help="only re-render <name>.md, .png and the per-value rows from <name>.json and its items",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        results = json.loads((out / f"{args.name}.json").read_text())
        write_report(results, pq.read_table(out / f"{args.name}_items.parquet").to_pylist(), out, args.name)
        return 0
    print(f"primary outcome (declared): {DECLARATION}", flush=True)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s)
    b = (
        dataclasses.replace(SMOKE, seeds=seeds[:1])
        if args.smoke
        else budget(args.steps, seeds, curve=() if args.final_only else None)
    )
    b = dataclasses.replace(b, lr=args.lr) if args.lr is not None else b
    b = dataclasses.replace(b, prefilter=args.prefilter)
    bases, variants = [x for x in args.bases.split(",") if x], [x for x in args.variants.split(",") if x]
    for name, chosen, known in (("bases", bases, BASES), ("variants", variants, VARIANTS)):
        if unknown := [x for x in chosen if x not in known]:
            ap.error(f"unknown {name} {unknown}; expected some of {list(known)}")
    started = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load(None, [])

    judges = {base: base_judge(cfg, RECIPES[base]) for base in bases}
    judge_ids = {base: weights_sha256(path)[:16] for base, path in judges.items()}
    runs: list[dict[str, Any]] = []
    for base in bases:
        for variant in variants:
            for seed in b.seeds:
                run_dir = work / f"{base}-{variant}-s{seed}"
                key = run_key(judge_ids[base], base, variant, seed, b)
                if args.finished_only and not finished(run_dir, key):
                    continue
                seconds, reused = ensure_run(run_dir, key, grpo_config(base, variant, seed, b, run_dir, judges[base]))
                runs.append(
                    {
                        "base": base,
                        "variant": variant,
                        "seed": seed,
                        "dir": run_dir,
                        "train_seconds": round(seconds, 1),
                        "reused": reused,
                        **reward_curve(run_dir),
                    }
                )
                print(f"{'reused' if reused else 'trained'} {base} {variant} seed {seed} ({seconds:.0f}s)", flush=True)
    if args.train_only:
        return 0

    recipe = RECIPES[bases[0]]
    items = looking_items(
        held_out_tuples(b.per_kind, LOOKING_SEED, recipe.image_size, recipe.objects, KINDS), LETTERS_SEED
    )
    balanced_letters(items)
    shown = [x for it in items for x in (it.pair.original, it.pair.swapped, it.blank)]
    training = [
        *(x for base in bases for x in training_items(RECIPES[base])),
        *(x for r in runs for x in read_items(r["dir"] / "data" / "ppjd")),
    ]
    assert_held_out(shown, training)
    held_out = f"{len(shown)} images of {len(items)} held-out tuples, none in {len(training)} training items"

    # judge -> per-item metrics; one row per judge, kind and forced; one parquet row per judge and item.
    rows, item_rows = [], []
    per_judge: dict[tuple, dict[str, np.ndarray]] = {}
    base_verdicts: dict[str, list[LookingVerdict]] = {}
    t0 = time.perf_counter()
    plan = [(base, "base", None, 0, judges[base]) for base in bases]
    plan += [(r["base"], r["variant"], r["seed"], s, judge_at(r["dir"], s, b)) for r in runs for s in b.curve]
    for base, variant, seed, step, path in plan:
        forced = variant == "base"
        recipe = RECIPES[base]
        part = parts(recipe)
        verdicts, rewards, score = evaluate(path, items, forced, recipe)
        if forced:
            base_verdicts[base] = verdicts
        run = next((r for r in runs if (r["base"], r["variant"], r["seed"]) == (base, variant, seed)), None)
        rewards["train_reward"] = train_reward(run["dir"], step) if run else None
        change = blank_change(base_verdicts[base], verdicts, part)
        ceiling = ceiling_test(base_verdicts[base], verdicts, part)
        for f in (False, True) if forced else (False,):
            metrics = per_item(verdicts, f) if f else {**per_item(verdicts, f), **score}
            label = "forced" if f else variant
            for kind in KINDS:
                for p in PARTS if part else PARTS[:1]:
                    mask = [v.kind == kind and p in ("all", part(v) if part else "all") for v in verdicts]
                    if not any(mask):
                        continue
                    keep, name = np.array(mask), kind if p == "all" else f"{kind}/{p}"
                    per_judge[(base, label, step, kind, p, seed)] = {m: v[keep] for m, v in metrics.items()}
                    rows.append(
                        {
                            "variant": label,
                            "base_judge": base,
                            "seed": seed,
                            "steps": step,
                            "kind": kind,
                            "part": p,
                            "forced": f,
                            "items": int(keep.sum()),
                            **{m: round(float(np.nanmean(v[keep])), 4) for m, v in metrics.items()},
                            # the rewards and the blank change are of the judge as it answers, not forced
                            **{m: None if f else x for m, x in rewards.items()},
                            "blank_change": None if f else change[name]["mean"],
                            # the paired swap test of the judge as it answers, and its paired test against the forced base judge
                            "swap_test_p": None if f else swap_test([v for v, k in zip(verdicts, mask) if k])["p"],
                            "vs_forced_p": None if f else ceiling[name]["p"],
                        }
                    )
        item_rows += [
            {
                "base_judge": base,
                "variant": variant,
                "seed": seed,
                "steps": step,
                "part": part(v) if part else "all",
                **v.row(),
            }
            for v in verdicts
        ]
        print(f"judged {base} {variant} seed {seed} step {step}", flush=True)
    eval_seconds = time.perf_counter() - t0

    results = {
        "declaration": {"primary": DECLARATION},
        "nulls": nulls(K),
        "rows": rows,
        "summary": summarise(rows, per_judge, b),
        "runs": [{k: v for k, v in r.items() if k != "dir"} for r in runs],
        "setup": {
            "budget": dataclasses.asdict(b),
            "bases": bases,
            "variants": variants,
            "base_weights": judge_ids,
            "held_out": held_out,
            "code": code_hash(),
            "seconds": {"wall": round(time.perf_counter() - started, 1), "eval": round(eval_seconds, 1)},
        },
    }
    pq.write_table(pa.Table.from_pylist(item_rows), out / f"{args.name}_items.parquet")
    write_report(results, item_rows, out, args.name)
    print(f"wrote {out / args.name}.json, .md, .png, _items.parquet in {time.perf_counter() - started:.0f}s")
    return 0


def write_report(results: dict[str, Any], item_rows: list[dict[str, Any]], out: Path, name: str) -> None:
    """The JSON (with the per-value rows of `item_rows`), the markdown table and the plot."""
    results["by_value"] = by_value(item_rows)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, out / f"{name}.png")
    print(markdown(results))


def by_value(item_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per judge (base, variant, steps) and per value the original image shows (each colour,
    each size): the items, correct first and image-following over every seed's verdicts; the
    base judge also forced."""
    cells: dict[tuple, list[tuple[bool, bool]]] = {}
    for r in item_rows:
        v = LookingVerdict(**{f.name: r[f.name] for f in dataclasses.fields(LookingVerdict)})
        cells.setdefault((r["base_judge"], r["variant"], r["steps"], v.kind, v.truth), []).append(follows_image(v))
        if v.forced:
            cells.setdefault((r["base_judge"], "forced", r["steps"], v.kind, v.truth), []).append(
                follows_image(v, forced=True)
            )
    return [
        {
            "base_judge": b,
            "variant": var,
            "steps": s,
            "kind": k,
            "value": value,
            "items": len(hits),
            "correct_first": round(float(np.mean([a for a, _ in hits])), 4),
            "image_following": round(float(np.mean([a and c for a, c in hits])), 4),
        }
        for (b, var, s, k, value), hits in sorted(cells.items(), key=str)
    ]


def summarise(
    rows: list[dict[str, Any]], per_judge: dict[tuple, dict[str, np.ndarray]], b: Budget
) -> list[dict[str, Any]]:
    """Per (base, variant, steps, kind): each metric's seed-mean with its t-interval and the
    hierarchical bootstrap, and the rewards' seed means."""
    out = []

    def key(r: dict[str, Any]) -> tuple:
        return r["base_judge"], r["variant"], r["steps"], r["kind"], r["part"]

    for base, variant, step, kind, part in sorted({key(r) for r in rows}, key=str):
        mine = [r for r in rows if key(r) == (base, variant, step, kind, part)]
        cell: dict[str, Any] = {
            "base_judge": base,
            "variant": variant,
            "steps": step,
            "kind": kind,
            "part": part,
            "seeds": len(mine),
            "items": mine[0]["items"],
        }
        for m in (*METRICS, *(SCORE_METRICS if variant != "forced" else ())):
            values = np.stack([per_judge[(base, variant, step, kind, part, r["seed"])][m] for r in mine])
            cell[m] = {**t_interval([r[m] for r in mine]), "bootstrap": hierarchical_bootstrap(values, b.bootstrap)}
        if variant not in ("base", "forced"):
            # trained minus the base judge on the same items, per seed (the base judge is greedy: one value)
            base_row = next(r for r in rows if key(r) == (base, "base", 0, kind, part))
            cell["gain"] = t_interval([r["image_following"] - base_row["image_following"] for r in mine])
        for m in ("reward_greedy", "reward_sampled", "train_reward", "blank_change"):
            defined = [r[m] for r in mine if r[m] is not None]
            cell[m] = round(float(np.mean(defined)), 4) if defined else None
        out.append(cell)
    return out


# --------------------------------------------------------------------------- report


def _pct(c: dict[str, Any]) -> str:
    if c["lo"] is None:
        return f"{100 * c['mean']:.0f}"
    return f"{100 * c['mean']:.0f} [{100 * c['lo']:.0f}, {100 * c['hi']:.0f}]"


def markdown(results: dict[str, Any]) -> str:
    null = results["nulls"]["drop_contradicting"]
    lines = [
        f"Held-out image-following (%, mean over seeds [95% t-interval]; bootstrap in the JSON) on independent tuples, "
        f"letters balanced, greedy. Null: {100 * null:.0f}% (drop the self-contradicting answer, guess per image); "
        'a text-only judge scores 0. `forced`: the base judge with its "by the image" disposition forced. '
        'Score protocol (the correct and the perception-error answer scored alone, same images): its "by the image" '
        "rate, and the error score(wrong) >= score(correct), both the mean of the two kinds. "
        "Rewards: greedy and sampled (temperature 1) on the held-out tuples, training reward of the 5 steps before.",
        "",
        "| base judge | variant | steps | seeds | image-following, colour | image-following, size | correct first, colour | "
        'correct first, size | blank correct first (colour, size) | "by the image", batch / score | score error | '
        "reward greedy / sampled / training |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {
        (c["base_judge"], c["variant"], c["steps"], c["kind"]): c
        for c in results["summary"]
        if c.get("part", "all") == "all"
    }
    for base, variant, step in sorted(
        {k[:3] for k in by}, key=lambda k: (k[0], k[1] not in ("base", "forced"), k[1], k[2])
    ):
        c, s = by[(base, variant, step, "color")], by[(base, variant, step, "size")]
        rewards = " / ".join(
            "-" if c[m] is None else f"{c[m]:.3f}" for m in ("reward_greedy", "reward_sampled", "train_reward")
        )

        def pooled(m: str) -> str:
            return "-" if m not in c else f"{100 * (c[m]['mean'] + s[m]['mean']) / 2:.0f}"

        lines.append(
            f"| {base} | {variant} | {step} | {c['seeds']} | {_pct(c['image_following'])} | {_pct(s['image_following'])} | "
            f"{_pct(c['correct_first'])} | {_pct(s['correct_first'])} | {_pct(c['blind_correct_first'])}, "
            f"{_pct(s['blind_correct_first'])} | {pooled('disposition_image')} / {pooled('disposition_score')} | "
            f"{pooled('score_error')} | {rewards} |"
        )
    last = {
        (c["base_judge"], c["variant"]): max(
            x["steps"] for x in results["summary"] if (x["base_judge"], x["variant"]) == (c["base_judge"], c["variant"])
        )
        for c in results["summary"]
    }
    lines += [
        "",
        "Per value the original image shows, each judge at its last step (all seeds' verdicts pooled): "
        "image-following % (correct first %), items.",
        "",
        "| base judge | variant | kind | value | image-following (correct first) | items |",
        "|---|---|---|---|---|---|",
    ]
    for row in results.get("by_value", []):
        if row["steps"] == last[(row["base_judge"], row["variant"])]:
            lines.append(
                f"| {row['base_judge']} | {row['variant']} | {row['kind']} | {row['value']} | "
                f"{100 * row['image_following']:.0f} ({100 * row['correct_first']:.0f}) | {row['items']} |"
            )
    parts = [c for c in results["summary"] if c.get("part", "all") != "all"]
    if parts:
        lines += [
            "",
            "The taught and untaught values (the base judge recipe's `untaught`: an item is untaught when either "
            "of its images shows one): image-following % [95% t-interval over seeds], and trained minus the base "
            "judge on the same items, points.",
            "",
            "| base judge | variant | steps | kind / part | items | seeds | image-following | minus the base judge |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(
            parts,
            key=lambda c: (
                c["base_judge"],
                c["variant"] not in ("base", "forced"),
                c["variant"],
                c["steps"],
                c["kind"],
                c["part"],
            ),
        ):
            gain = c.get("gain")
            shown = (
                "-"
                if gain is None
                else (
                    f"{100 * gain['mean']:+.0f}"
                    if gain["lo"] is None
                    else f"{100 * gain['mean']:+.0f} [{100 * gain['lo']:+.0f}, {100 * gain['hi']:+.0f}]"
                )
            )
            lines.append(
                f"| {c['base_judge']} | {c['variant']} | {c['steps']} | {c['kind']} / {c['part']} | {c['items']} | "
                f"{c['seeds']} | {_pct(c['image_following'])} | {shown} |"
            )
    curves: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results["runs"]:
        if "reward_rise" in r:
            curves.setdefault((r["base"], r["variant"]), []).append(r)
    if curves:
        lines += [
            "",
            "The sampled training reward a user watches: mean of the last 5 steps minus the first 5 (its ranking "
            "part, without the image-contrast bonus, in brackets), and the groups with all-equal rewards.",
            "",
            "| base judge | variant | seeds | reward first -> last | rise [95% t-interval] | ranking rise | all-equal groups |",
            "|---|---|---|---|---|---|---|",
        ]
        for (base, variant), rs in sorted(curves.items()):
            rise = t_interval([r["reward_rise"] for r in rs])
            lines.append(
                f"| {base} | {variant} | {len(rs)} | {np.mean([r['reward_first'] for r in rs]):.3f} -> "
                f"{np.mean([r['reward_last'] for r in rs]):.3f} | {rise['mean']:+.3f}"
                + ("" if rise["lo"] is None else f" [{rise['lo']:+.3f}, {rise['hi']:+.3f}]")
                + f" | {np.mean([r['ranking_rise'] for r in rs]):+.3f} | {100 * np.mean([r['frac_zero_std'] for r in rs]):.0f}% |"
            )
    setup = results["setup"]
    lines += [
        "",
        f"Runs: {len(results['runs'])}; {setup['held_out']}; wall {setup['seconds']['wall']:.0f} s "
        f"(evaluation {setup['seconds']['eval']:.0f} s); code {setup['code'][:12]}.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    bases = sorted({c["base_judge"] for c in summary})
    fig, axes = plt.subplots(len(bases), len(KINDS), figsize=(10, 3.6 * len(bases)), squeeze=False)
    for i, base in enumerate(bases):
        for j, kind in enumerate(KINDS):
            ax = axes[i][j]
            cells = [
                c for c in summary if c["base_judge"] == base and c["kind"] == kind and c.get("part", "all") == "all"
            ]
            base_cell = next(c for c in cells if c["variant"] == "base")
            forced = next(c for c in cells if c["variant"] == "forced")
            for variant in sorted({c["variant"] for c in cells} - {"base", "forced"}):
                curve = sorted([c for c in cells if c["variant"] == variant], key=lambda c: c["steps"])
                x = [0] + [c["steps"] for c in curve]
                y = [100 * base_cell["image_following"]["mean"]] + [100 * c["image_following"]["mean"] for c in curve]
                ax.plot(x, y, marker="o", label=variant)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    lo = [y[0]] + [
                        100
                        * (
                            c["image_following"]["lo"]
                            if c["image_following"]["lo"] is not None
                            else c["image_following"]["mean"]
                        )
                        for c in curve
                    ]
                    hi = [y[0]] + [
                        100
                        * (
                            c["image_following"]["hi"]
                            if c["image_following"]["hi"] is not None
                            else c["image_following"]["mean"]
                        )
                        for c in curve
                    ]
                ax.fill_between(x, lo, hi, alpha=0.15)
            ax.axhline(
                100 * results["nulls"]["drop_contradicting"], ls="--", color="grey", lw=1, label="null (1/(K-1)^2)"
            )
            ax.axhline(100 * forced["image_following"]["mean"], ls=":", color="black", lw=1, label="base judge, forced")
            ax.set_title(f"{base}: {kind}", fontsize=9)
            ax.set_xlabel("GRPO steps")
            ax.set_ylabel("held-out image-following, %")
            ax.set_ylim(0, 100)
            ax.legend(fontsize=7)
    fig.suptitle("Image-following on held-out independent tuples (seed means, 95% t-intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
