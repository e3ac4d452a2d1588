"""Does GRPO on PPJD make a judge's verdict follow the image? The miniature study.

    python benchmarks/study_bias.py              # the full study: 5 seeds a variant, 300 items a set
    python benchmarks/study_bias.py --quick      # 2 seeds a variant, 150 items a set
    python benchmarks/study_bias.py --smoke      # every stage on 8 items and 2 steps (`pytest -m extended`)
    python benchmarks/study_bias.py --variants nested_kendall --seeds 0,1   # a part of a study

Declared before any run (keep this section as written; results that disagree are reported, not
re-declared):

**Primary outcomes**, each per question kind (color, size), with its change from the base judge:
  (a) the *fact-following rate* on held-out swapped tuples of the independent construction:
      the judge's top choice states the fact the image shows, both on the original image and on
      the counterfactual one (`pjray.eval.swap`; 0 for any judge that ranks from the text alone);
  (b) the *score-protocol error* on held-out items: score(perceptually wrong answer) >=
      score(correct answer), split into Mode (a) (the probe answer is wrong too) and Mode (b)
      (the judge sees the fact and still believes the answer) (`pjray.eval.bias.diagnose`).
A variant "improves" an outcome when the interval of its paired change from the base judge
excludes 0 in the better direction; how many of its seeds improved on their own is reported
beside it. **Everything else is secondary**: batch-ranking format, correct-first and exact
order on both constructions, image-following, same top choice under both images,
correct-first with a grey image, the probe accuracy, and the teacher-forced probability of the
"by the image" disposition on score prompts.

Judges: the base judge (`pjray.models.base_judge`, the one pjray ships) and the base judge
after GRPO at the default run's budget (configs/demo.yaml: its steps, prompts per step, group
size, training items and learning rate), each variant with 5 seeds (`trainer.seed`; the same
training data, `data.seed=0`):

| variant | data (train content split, K=3) | reward |
|---|---|---|
| nested_levenshtein | PPJD tuples, nested construction (the paper) | batch ranking, Levenshtein (the paper) |
| nested_kendall | the same tuples | batch ranking, Kendall (the released code) |
| independent_levenshtein | PPJD tuples, independent construction | Levenshtein |
| independent_kendall | the same tuples | Kendall |
| no_perception | tuples with reasoning errors only (correct > 1 > 2 broken steps) | Levenshtein |

The paper's pairwise baseline is left out: the base judge is never trained on the K=2 pair
protocol (its pairwise format rate is 0 at the start, so GRPO gets no reward to follow), and a
fair pairwise baseline needs a base judge trained on that protocol too: a change of the base
judge's recipe, left for later.

Every run is the whole system of the default run: `pjray.rl.trainer.train` (Ray Data PPJD build,
DeepSpeed learner that generates with the weights it trains, reward pool, checkpoint, HF
export). A finished run directory (the study's `hf_model/COMPLETE`, written after the export,
and `study_run.json` naming the same base judge, by the hash of its weights, variant, seed and
budget) is reused, so a study run in parts (--variants, --seeds) adds up; a started run of the
same key resumes from its checkpoint, if any; a run directory of another key is trained anew.

Evaluation sets (fresh seeds: no committed result used them), all of one-object scenes of the
**held-out content split** (`pjray.data.scenes.SPLITS`; asserted by content with
`pjray.eval.held_out.assert_held_out` against the base judge's judging items and every run's;
only the base judge's frozen perception front-end saw all content, as a pretrained vision encoder
does: `BaseJudgeRecipe.vision_split`):
  - diagnosis: score protocol on the correct and the perceptually wrong answer, and the probe;
  - K=3 tuples of the independent construction (and their image swaps and grey-image copies);
  - K=3 tuples of the nested construction of the same scenes.
Kinds alternate color, size. Every judge answers greedily, with the same prompts and letters.
The disposition probability: on each score prompt of the diagnosis, teacher-forced after
"Image: <truth>. Verdict: by the" (the base judge's own think text), the probability of the
next token " image" (one token of the judge's tokenizer, as is " text").
Baselines: the text-only ranker (`pjray.ppjd.shortcuts.audit`) on each tuple set, chance, and
each judge's own correct-first with a grey image.

Intervals: 95% percentile intervals of a hierarchical bootstrap: each replicate draws the judge's
seeds with replacement, then the items with replacement (the same item draws for every judge,
so a change from the base judge is paired), and averages. Per-seed values are in the JSON.

Writes bias_study.{json,md,png} into benchmarks/results (or --out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pjray.config import Config, load
from pjray.data.prompts import render_batch
from pjray.data.sampler import shown_order
from pjray.data.scenes import split_qas
from pjray.data.sources import read_items, write_items
from pjray.eval.bias import DiagnosisItem, diagnose, diagnosis_item, item_prompts
from pjray.eval.held_out import assert_held_out, looking_verdicts, training_items
from pjray.eval.swap import follows, swap_pair
from pjray.models.base_judge import BaseJudgeRecipe, disposition
from pjray.recipes.base_judge import SHIPPED, base_judge, cache_root, recipe_hash, weights_sha256
from pjray.ppjd.perturb import _scene_seed, ranked_item, scene_items
from pjray.ppjd.shortcuts import audit
from pjray.reward import judge_reward
from pjray.types import JudgeItem, JudgePrompt

VARIANTS: dict[str, list[str]] = {
    "nested_levenshtein": ["data.construction=nested", "reward.metric=levenshtein"],
    "nested_kendall": ["data.construction=nested", "reward.metric=kendall"],
    "independent_levenshtein": ["data.construction=independent", "reward.metric=levenshtein"],
    "independent_kendall": ["data.construction=independent", "reward.metric=kendall"],
    "no_perception": ["reward.metric=levenshtein"],  # + its own parquet (reasoning errors only)
}
TRAIN_DATA_SEED = 0
# Held-out evaluation seeds no committed result used: diagnosis, tuples, the letters shown.
EVAL_DIAGNOSIS_SEED, EVAL_TUPLE_SEED, EVAL_LETTERS_SEED = 8101, 8102, 8103
KINDS = ("color", "size")
PAPER = {  # Perception-Judge-Qwen3 vs its base (the paper's Table 1 / Section 5), for context
    "base": {"error_rate": 0.235, "mode_b_rate": 0.141},
    "grpo": {"error_rate": 0.143, "mode_b_rate": 0.076},
}

# Outcome groups -> their per-item metrics; +1: higher is better, -1: lower is better, 0: neither.
GROUPS: dict[str, dict[str, int]] = {
    "diagnosis": {"error_rate": -1, "mode_a_rate": -1, "mode_b_rate": -1, "probe_accuracy": 1, "p_image": 1},
    "looking": {
        "fact_following": 1, "image_following": 1, "same_top": -1,
        "correct_first_original": 1, "correct_first_swapped": 1, "blind_correct_first": 0,
    },
    "ranking_independent": {"format": 1, "correct_first": 1, "exact": 1},
    "ranking_nested": {"format": 1, "correct_first": 1, "exact": 1},
}  # fmt: skip
PRIMARY = (("looking", "fact_following"), ("diagnosis", "error_rate"))  # per kind (declared above)
SLICES = ("pooled", *KINDS)


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    prompts_per_step: int
    group_size: int
    train_items: int
    lr: float
    eval_items: int  # per evaluation set
    seeds: tuple[int, ...]
    bootstrap: int = 2000


def default_budget(eval_items: int, seeds: tuple[int, ...]) -> Budget:
    """The default run's budget (configs/demo.yaml): its steps, prompts, group size, items and lr."""
    cfg = load(None, [])
    return Budget(
        steps=cfg.trainer.steps, prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.algo.group_size,
        train_items=cfg.data.num_items, lr=cfg.learner.lr, eval_items=eval_items, seeds=seeds,
    )  # fmt: skip


FULL = default_budget(eval_items=300, seeds=(0, 1, 2, 3, 4))
QUICK = default_budget(eval_items=150, seeds=(0, 1))
# Every stage of the study on a few items and steps: what the test suite runs (its numbers mean
# nothing).
SMOKE = dataclasses.replace(
    FULL, steps=2, prompts_per_step=4, group_size=4, train_items=8, eval_items=8, seeds=(0,), bootstrap=200
)


# --------------------------------------------------------------------------- statistics


def hierarchical_bootstrap(values: np.ndarray, reps: int, seed: int, base: np.ndarray | None = None) -> dict[str, float | None]:
    """Mean of `values` [seeds, items] (nan: undefined for that item), or with `base` [items] its
    mean change from `base`, paired by item, with a 95% percentile interval: each replicate draws
    seeds with replacement, then items with replacement, and averages. The item draws depend on
    (reps, items, seed) only, so judges with any number of seeds share them."""
    values = np.atleast_2d(np.asarray(values, dtype=float))
    if base is not None:
        values = values - np.asarray(base, dtype=float)[None, :]
    n_seeds, n_items = values.shape
    items = np.random.default_rng([seed, 0]).integers(0, n_items, size=(reps, n_items))
    seeds = np.random.default_rng([seed, 1]).integers(0, n_seeds, size=(reps, n_seeds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan draws: nan, dropped below
        dist = np.nanmean(values[seeds[:, :, None], items[:, None, :]], axis=(1, 2))
        point = np.nanmean(values)
    dist = dist[~np.isnan(dist)]
    if np.isnan(point) or not len(dist):
        return {"mean": None, "lo": None, "hi": None}
    lo, hi = np.percentile(dist, [2.5, 97.5])
    return {"mean": float(point), "lo": float(lo), "hi": float(hi)}


def seed_means(values: np.ndarray) -> list[float | None]:
    """Each seed's mean over its items (None where none is defined)."""
    return [None if np.all(np.isnan(row)) else float(np.nanmean(row)) for row in np.atleast_2d(values)]


def seeds_improved(values: np.ndarray, base: np.ndarray, direction: int) -> int:
    """How many seeds beat the base judge in `direction`: a mean paired change (over the items
    defined for both) above 0."""
    changes = seed_means(np.atleast_2d(values) - np.asarray(base)[None, :])
    return sum(c is not None and direction * c > 0 for c in changes)


def summarise(values: np.ndarray, base: np.ndarray | None, direction: int, reps: int) -> dict[str, Any]:
    """One metric of one judge on one slice of items: mean [CI], per-seed means, and for a
    trained judge its paired change from the base judge and how many seeds improved."""
    values = np.atleast_2d(values)
    out: dict[str, Any] = {
        **hierarchical_bootstrap(values, reps, seed=1),
        "n": int(np.sum(~np.isnan(values))), "of": int(values.size), "per_seed": seed_means(values),
    }  # fmt: skip
    if base is not None:
        out["change"] = hierarchical_bootstrap(values, reps, seed=1, base=base)
        if direction:
            out["seeds_improved"] = seeds_improved(values, base, direction)
    return out


# --------------------------------------------------------------------------- data


def train_items_no_perception(recipe: BaseJudgeRecipe, n: int) -> list[JudgeItem]:
    """The ablation's tuples: the scenes and questions of the PPJD scene job (train content
    split, data.seed), with reasoning-error levels only."""
    qas = split_qas(n, partial(_scene_seed, TRAIN_DATA_SEED), "train", recipe.image_size, recipe.kinds, recipe.objects)
    return [ranked_item(qa, 3, perception=False) for qa in qas]


@dataclasses.dataclass(frozen=True)
class EvalSets:
    diag_items: list[JudgeItem]  # the diagnosis' ranked items (their truth, for the disposition)
    diag: list[DiagnosisItem]
    tuples: dict[str, list[JudgeItem]]  # construction -> K=3 tuples of the same scenes
    batches: dict[str, list[JudgePrompt]]  # construction -> batch-ranking prompts (fixed letters)

    def kinds(self) -> dict[str, np.ndarray]:
        """The question kind of each item, per outcome group."""
        tuple_kinds = {c: np.array([it.meta["kind"] for it in items]) for c, items in self.tuples.items()}
        return {
            "diagnosis": np.array([d.kind for d in self.diag]), "looking": tuple_kinds["independent"],
            "ranking_independent": tuple_kinds["independent"], "ranking_nested": tuple_kinds["nested"],
        }  # fmt: skip


def eval_sets(recipe: BaseJudgeRecipe, n: int) -> EvalSets:
    def items(seed: int, construction: str) -> list[JudgeItem]:
        return scene_items(n, seed, 3, recipe.image_size, KINDS, recipe.objects, "held_out", construction)

    diag_items = items(EVAL_DIAGNOSIS_SEED, "independent")  # only level 1 (one perception error) is used
    tuples = {c: items(EVAL_TUPLE_SEED, c) for c in ("independent", "nested")}
    # Balanced letters (as the training stream shows them): every block of 3! prompts shows the
    # levels (correct, ...) in every order once, so a judge that keeps the shown order is at chance.
    batches = {
        c: [render_batch(it, None, shown=tuple(it.order[j] for j in shown_order(i, 3, EVAL_LETTERS_SEED))) for i, it in enumerate(its)]
        for c, its in tuples.items()
    }  # fmt: skip
    return EvalSets(diag_items, [diagnosis_item(it) for it in diag_items], tuples, batches)


def held_out_check(recipe: BaseJudgeRecipe, sets: EvalSets, run_dirs: list[Path]) -> str:
    """Assert by content that no evaluation item (nor swapped image) occurs in any training set."""
    evaluation = [*sets.diag_items, *sets.tuples["independent"], *sets.tuples["nested"]]
    evaluation += [swap_pair(it).swapped for it in sets.tuples["independent"]]
    training = [*training_items(recipe), *(it for d in run_dirs for it in run_training_items(d))]
    assert_held_out(evaluation, training)
    return f"{len(evaluation)} evaluation items of the held-out content split, none in {len(training)} training items"


def run_training_items(run_dir: Path) -> list[JudgeItem]:
    cfg = json.loads((run_dir / "config.json").read_text())
    if cfg["data"]["source"] == "parquet":
        return read_items(cfg["data"]["path"])
    return read_items(run_dir / "data" / "ppjd")


# --------------------------------------------------------------------------- judging


def judge_engine(path: str) -> Any:
    """Greedy HF engine on the judge at `path`, with the default run's response length."""
    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rl.rollout import HFEngine

    rollout = RolloutConfig(max_new_tokens=load(None, []).rollout.max_new_tokens, temperature=1.0, top_k=1)
    return HFEngine(path, ModelConfig(), rollout, max_batch_prompts=32)


def evaluate_judge(path: str, sets: EvalSets) -> dict[str, dict[str, np.ndarray]]:
    """Per-item outcomes (nan: undefined for that item) of the judge at `path`, per group."""
    engine = judge_engine(path)

    def generate(prompts: list[JudgePrompt], seed: int) -> list[str]:
        return [c.text for c in engine.generate(list(prompts), 1, seed)]

    out = {"diagnosis": {**diagnosis_outcomes(generate, sets.diag), "p_image": image_disposition(engine, sets)}}
    texts = {c: generate(b, 0) for c, b in sets.batches.items()}
    for c in sets.batches:
        out[f"ranking_{c}"] = ranking_outcomes(sets.batches[c], texts[c])
    verdicts, blind = looking_verdicts(engine, sets.tuples["independent"], sets.batches["independent"], texts["independent"])
    per_item = [follows([v]) for v in verdicts]  # each rate over one item: 0 or 1
    out["looking"] = {m: np.array([float(r[m]) for r in per_item]) for m in GROUPS["looking"] if m != "blind_correct_first"}
    out["looking"]["blind_correct_first"] = np.array(blind, dtype=float)
    return out


def diagnosis_outcomes(generate: Any, diag: list[DiagnosisItem]) -> dict[str, np.ndarray]:
    _, records, _ = diagnose(generate, diag, seed=0)
    nan = np.nan
    error = np.array([nan if r.correct_score is None or r.wrong_score is None else float(r.wrong_score >= r.correct_score) for r in records])
    probe = np.array([nan if r.probe_ok is None else float(r.probe_ok) for r in records])
    scored = ~np.isnan(error)
    return {
        "error_rate": error, "probe_accuracy": probe,
        "mode_a_rate": np.where(scored, (error == 1) & (probe == 0), nan),
        "mode_b_rate": np.where(scored, (error == 1) & (probe == 1), nan),
    }  # fmt: skip


def ranking_outcomes(batch: list[JudgePrompt], texts: list[str]) -> dict[str, np.ndarray]:
    rewards = [judge_reward(t, p.target, think_prefilled=True) for p, t in zip(batch, texts)]
    ok = [r.format == 1.0 and r.pred is not None for r in rewards]
    return {
        "format": np.array(ok, dtype=float),
        "correct_first": np.array([o and r.pred[:1] == p.target[:1] for o, r, p in zip(ok, rewards, batch)], dtype=float),
        "exact": np.array([o and r.pred == p.target for o, r, p in zip(ok, rewards, batch)], dtype=float),
    }


def disposition_prefix(truth: str) -> str:
    """The base judge's think text up to its disposition word (`score_target`)."""
    return f"Image: {truth}. " + disposition(True).removesuffix(" image.")


def image_disposition(engine: Any, sets: EvalSets, chunk: int = 32) -> np.ndarray:
    """Per diagnosis item, the mean over its two score prompts of the probability of " image"
    as the next token after `disposition_prefix`, teacher-forced as the learner reads a
    response (the rendered prompt, then the response's own token ids)."""
    import torch

    from pjray.models.loading import render_chat
    from pjray.rl.logprobs import collate, forward_logprobs
    from pjray.types import Experience

    tok = engine.processor.tokenizer
    word = {w: tok(f" {w}", add_special_tokens=False).input_ids[0] for w in ("image", "text")}
    assert word["image"] != word["text"], "the disposition words share their first token"
    experiences = []
    for item, d in zip(sets.diag_items, sets.diag):
        prefix = disposition_prefix(str(item.meta["truth"]))
        ids = tok(prefix, add_special_tokens=False).input_ids
        assert tok(prefix + " image.", add_special_tokens=False).input_ids[: len(ids)] == ids, prefix
        for prompt in item_prompts(d)[:2]:  # score(correct), score(wrong)
            text = render_chat(engine.processor, prompt, think_prefix=engine.model_cfg.think_prefix)
            experiences.append(Experience(text, prompt.image, (*ids, word["image"]), advantage=0.0))
    probs = []
    with torch.no_grad():
        for start in range(0, len(experiences), chunk):
            part = experiences[start : start + chunk]
            _, logits = forward_logprobs(engine.model, engine.processor, collate(engine.processor, part), shared_prefix=False)
            last = np.cumsum([len(e.response_ids) for e in part]) - 1  # each row's position after the prefix
            probs += torch.softmax(logits[last].float(), -1)[:, word["image"]].tolist()
    return np.array(probs).reshape(-1, 2).mean(axis=1)


# --------------------------------------------------------------------------- training


def grpo_config(recipe: BaseJudgeRecipe, variant: str, seed: int, budget: Budget, run_dir: Path, judge: str, data: str) -> Config:
    """The embedded default run's config, from the base judge, at the study's budget."""
    overrides = [
        f"data.scene_kinds=[{','.join(recipe.kinds)}]", f"data.scene_objects=[{recipe.objects[0]},{recipe.objects[1]}]",
        "data.scene_split=train", f"model.path={judge}", f"trainer.run_dir={run_dir}", f"trainer.seed={seed}",
        f"trainer.steps={budget.steps}", f"trainer.prompts_per_step={budget.prompts_per_step}",
        f"algo.group_size={budget.group_size}", f"data.num_items={budget.train_items}", f"learner.lr={budget.lr}",
        f"data.seed={TRAIN_DATA_SEED}", "tracking.wandb=false", "trainer.save_every=0", *VARIANTS[variant],
    ]  # fmt: skip
    if data:
        overrides += ["data.source=parquet", f"data.path={data}"]
    return load(None, overrides)


def run_key(base_judge: dict[str, str], variant: str, seed: int, budget: Budget) -> dict[str, Any]:
    """What decides a run's judge: a run directory with another key is never reused."""
    train = {k: getattr(budget, k) for k in ("steps", "prompts_per_step", "group_size", "train_items", "lr")}
    return {"base_judge": base_judge, "variant": variant, "seed": seed, "budget": train, "overrides": VARIANTS[variant]}


def ensure_run(run_dir: Path, key: dict[str, Any], cfg: Config) -> tuple[float, bool]:
    """Train the run into `run_dir` unless it holds a finished run of the same key; returns
    (its training seconds, whether it was reused). A started run of the same key resumes from
    its checkpoint, if any (trainer.resume=auto); a run of another key is deleted."""
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
    train(cfg)
    seconds = time.perf_counter() - t0
    (run_dir / "hf_model" / "COMPLETE").touch()  # the export is whole
    marker.write_text(json.dumps({"key": key, "train_seconds": seconds}, indent=2))
    return seconds, False


def reward_first_last(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = max(1, min(3, len(rewards) // 2))
    return [round(float(np.mean(rewards[:k])), 3), round(float(np.mean(rewards[-k:])), 3)]


# --------------------------------------------------------------------------- the study


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 seeds a variant, 150 items a set")
    mode.add_argument("--smoke", action="store_true", help="every stage on a few items and steps (a test, not a study)")
    ap.add_argument("--out", default="benchmarks/results", help="where bias_study.{json,md,png} go")
    ap.add_argument("--work", default="runs/bias_study", help="run directories of the GRPO judges (reused when finished)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--seeds", default="", help="comma-separated GRPO seeds (default: the mode's)")
    args = ap.parse_args(argv)
    budget = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.seeds:
        budget = dataclasses.replace(budget, seeds=tuple(int(s) for s in args.seeds.split(",") if s))
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    started = time.perf_counter()
    work, out = Path(args.work).resolve(), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, Any] = {}

    recipe = BaseJudgeRecipe()
    t0 = time.perf_counter()
    judge = base_judge(load(None, []), recipe)
    base_id = {"weights_sha256": weights_sha256(judge)[:16]}  # the weights decide the judge
    timing["base_judge"] = time.perf_counter() - t0
    print(f"base judge: {judge} ({timing['base_judge']:.0f}s)", flush=True)

    t0 = time.perf_counter()
    no_perception = work / "no_perception.parquet"
    write_items(train_items_no_perception(recipe, budget.train_items), no_perception)
    sets = eval_sets(recipe, budget.eval_items)
    timing["eval_data"] = time.perf_counter() - t0

    runs: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        for seed in budget.seeds:
            run_dir = work / f"{variant}-s{seed}"
            data = str(no_perception) if variant == "no_perception" else ""
            cfg = grpo_config(recipe, variant, seed, budget, run_dir, str(judge), data)
            seconds, reused = ensure_run(run_dir, run_key(base_id, variant, seed, budget), cfg)
            runs.setdefault(variant, []).append({"seed": seed, "dir": run_dir, "train_seconds": round(seconds, 1), "reused": reused})
            print(f"{'reused' if reused else 'trained'} {variant} seed {seed} ({seconds:.0f}s)", flush=True)

    t0 = time.perf_counter()
    held_out = held_out_check(recipe, sets, [r["dir"] for rs in runs.values() for r in rs])
    timing["held_out_check"] = time.perf_counter() - t0

    per_item: dict[str, dict[str, dict[str, np.ndarray]]] = {}  # judge -> group -> metric -> [seeds, items]
    timing["eval"] = {}
    for name, paths in [("base", [judge]), *((v, [r["dir"] / "hf_model" for r in rs]) for v, rs in runs.items())]:
        t0 = time.perf_counter()
        outcomes = [evaluate_judge(str(p), sets) for p in paths]
        per_item[name] = {g: {m: np.stack([o[g][m] for o in outcomes]) for m in GROUPS[g]} for g in GROUPS}
        timing["eval"][name] = time.perf_counter() - t0
        print(f"evaluated {name} ({timing['eval'][name]:.0f}s)", flush=True)

    t0 = time.perf_counter()
    results = {
        "declaration": {"primary": [f"{g}/{m} per kind" for g, m in PRIMARY], "groups": GROUPS},
        "judges": judges_summary(per_item, sets.kinds(), budget.bootstrap),
        "baselines": baselines(sets),
    }
    for name, rs in runs.items():
        results["judges"][name]["runs"] = [
            {"seed": r["seed"], "train_seconds": r["train_seconds"], "reused": r["reused"], "reward_first_last": reward_first_last(r["dir"])}
            for r in rs
        ]  # fmt: skip
    timing["summary"] = time.perf_counter() - t0
    timing["wall"] = time.perf_counter() - started
    results["setup"] = {
        "budget": dataclasses.asdict(budget), "variants": variants, "recipe": recipe.to_dict(),
        # No machine paths: the shipped judge, or the cache's.
        "base_judge": "pjray/assets/base_judge" if judge.is_relative_to(SHIPPED) else f"<pjray cache>/{judge.relative_to(cache_root())}",
        "base_judge_id": base_id, "base_judge_recipe_hash": recipe_hash(recipe),
        "eval_seeds": {"diagnosis": EVAL_DIAGNOSIS_SEED, "tuples": EVAL_TUPLE_SEED, "letters": EVAL_LETTERS_SEED},
        "eval_items": {"diagnosis": len(sets.diag), **{c: len(v) for c, v in sets.tuples.items()}},
        "held_out_check": held_out, "seconds": timing, "paper": PAPER,
    }  # fmt: skip
    (out / "bias_study.json").write_text(json.dumps(results, indent=2))
    (out / "bias_study.md").write_text(markdown(results))
    plot(results, out / "bias_study.png")
    print(markdown(results))
    print(f"wrote {out / 'bias_study.json'}, .md, .png in {time.perf_counter() - started:.0f}s")
    return 0


def judges_summary(per_item: dict[str, Any], kinds: dict[str, np.ndarray], reps: int) -> dict[str, Any]:
    """judge -> {"outcomes": group -> slice (pooled, color, size) -> metric -> `summarise`}."""
    out: dict[str, Any] = {}
    for name, groups in per_item.items():
        outcomes: dict[str, Any] = {}
        for g, metrics in groups.items():
            outcomes[g] = {}
            for s in SLICES:
                keep = np.ones(len(kinds[g]), dtype=bool) if s == "pooled" else kinds[g] == s
                outcomes[g][s] = {
                    m: summarise(v[:, keep], None if name == "base" else per_item["base"][g][m][0, keep], GROUPS[g][m], reps)
                    for m, v in metrics.items()
                }  # fmt: skip
        out[name] = {"outcomes": outcomes}
    return out


def baselines(sets: EvalSets) -> dict[str, Any]:
    """The text-only ranker and chance on each tuple set, pooled and per kind."""

    def row(a: dict[str, Any]) -> dict[str, float]:
        return {k: a[k] for k in ("correct_first", "exact", "chance_correct_first", "chance_exact")}

    out = {}
    for c, items in sets.tuples.items():
        a = audit(items)
        out[f"ranking_{c}"] = {"pooled": row(a), **{k: row(v) for k, v in a["by_kind"].items()}}
    # Under both images a text-only ranker keeps its top choice: it never follows the fact.
    out["looking"] = {s: {"fact_following": 0.0, "image_following": 0.0, "same_top": 1.0} for s in SLICES}
    return out


# --------------------------------------------------------------------------- report

LABELS = {
    "error_rate": "error", "mode_a_rate": "Mode (a)", "mode_b_rate": "Mode (b)", "probe_accuracy": "probe acc",
    "p_image": 'P("image")', "fact_following": "fact-following", "image_following": "image-following",
    "same_top": "same top", "correct_first_original": "correct first", "correct_first_swapped": "correct first (swapped)",
    "blind_correct_first": "correct first (grey image)", "format": "format", "correct_first": "correct first", "exact": "exact",
}  # fmt: skip
TITLES = {
    "diagnosis": "Score-protocol diagnosis (held-out items)",
    "looking": "Image swap on independent tuples (held-out)",
    "ranking_independent": "Batch ranking, independent tuples (held-out)",
    "ranking_nested": "Batch ranking, nested tuples of the same scenes (held-out)",
}


def _ci(c: dict[str, Any], signed: bool = False) -> str:
    if c["mean"] is None:
        return "-"
    sign = "+" if signed else ""
    return f"{100 * c['mean']:{sign}.1f} [{100 * c['lo']:{sign}.1f}, {100 * c['hi']:{sign}.1f}]"


def _cell(m: dict[str, Any]) -> str:
    """Level [CI]; for a trained judge also its change [CI] and seeds improved."""
    cell = _ci(m)
    if "change" in m:
        cell += f"; Δ {_ci(m['change'], signed=True)}"
        if "seeds_improved" in m:
            cell += f", {m['seeds_improved']}/{len(m['per_seed'])} seeds better"
    return cell


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]


def markdown(results: dict[str, Any]) -> str:
    judges, base = results["judges"], results["baselines"]
    setup = results["setup"]
    lines = [
        "Percent of held-out items: mean [95% CI] over seeds and items (hierarchical bootstrap); for a trained "
        "judge, Δ: its paired change from the base judge [95% CI], and how many of its seeds beat the base judge. "
        "n: the (seed, item) values defined for the group's first metric (a score or probe answer can be unreadable).",
        "",
        "## Primary outcomes (declared before the run)",
        "",
    ]
    cols = [(g, m, s) for g, m in PRIMARY for s in KINDS]
    rows = [[name] + [_cell(j["outcomes"][g][s][m]) for g, m, s in cols] for name, j in judges.items()]
    rows.append(["text-only ranker"] + ["0.0 (by construction)" if g == "looking" else "-" for g, _, _ in cols])
    lines += _table(["judge"] + [f"{LABELS[m]}, {s}" for _, m, s in cols], rows)
    paper = setup["paper"]
    lines += [f"The paper's error rates (all kinds, its own benchmark), for context: base {100 * paper['base']['error_rate']:.1f}% "
              f"(Mode (b) {100 * paper['base']['mode_b_rate']:.1f}%), after GRPO {100 * paper['grpo']['error_rate']:.1f}% "
              f"(Mode (b) {100 * paper['grpo']['mode_b_rate']:.1f}%).", ""]  # fmt: skip
    for g, metrics in GROUPS.items():
        lines += [f"## {TITLES[g]}, all kinds", ""]
        rows = [[name, str(j["outcomes"][g]["pooled"][next(iter(metrics))]["n"])] + [_cell(j["outcomes"][g]["pooled"][m]) for m in metrics]
                for name, j in judges.items()]  # fmt: skip
        if g.startswith("ranking"):
            b = base[g]["pooled"]
            rows.append(["text-only ranker", "-", "-", _pct(b["correct_first"]), _pct(b["exact"])])
            rows.append(["chance", "-", "-", _pct(b["chance_correct_first"]), _pct(b["chance_exact"])])
        if g == "looking":
            rows.append(["text-only ranker", "-"] + [_pct(base[g]["pooled"][m]) if m in base[g]["pooled"] else "-" for m in metrics])
        if g == "diagnosis":
            for name, p in paper.items():
                rows.append([f"paper, {name}", "-", _pct(p["error_rate"]), "-", _pct(p["mode_b_rate"]), "-", "-"])
        lines += _table(["judge", "n"] + [LABELS[m] for m in metrics], rows)
    t = setup["seconds"]
    lines += [
        "## Runs and wall time",
        "",
        *(f"- {name}: seeds {[r['seed'] for r in j['runs']]}, training {[r['train_seconds'] for r in j['runs']]} s "
          f"(reused: {[r['reused'] for r in j['runs']]}), reward first -> last steps {[r['reward_first_last'] for r in j['runs']]}"
          for name, j in judges.items() if "runs" in j),  # fmt: skip
        f"- evaluation: {', '.join(f'{k} {v:.0f} s' for k, v in t['eval'].items())}",
        f"- wall time {t['wall']:.0f} s (base judge {t['base_judge']:.0f} s, data {t['eval_data']:.0f} s, "
        f"held-out check {t['held_out_check']:.0f} s); {setup['held_out_check']}",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["judges"])
    fig, axes = plt.subplots(1, len(PRIMARY), figsize=(11, 4))
    width = 0.8 / len(names)
    for ax, (g, m) in zip(axes, PRIMARY):
        for j, name in enumerate(names):
            cells = [results["judges"][name]["outcomes"][g][s][m] for s in KINDS]
            means = [100 * (c["mean"] or 0.0) for c in cells]
            err = [[100 * (c["mean"] - c["lo"]) if c["mean"] is not None else 0 for c in cells],
                   [100 * (c["hi"] - c["mean"]) if c["mean"] is not None else 0 for c in cells]]  # fmt: skip
            ax.bar([i + j * width for i in range(len(KINDS))], means, width, yerr=err, capsize=3, label=name)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(KINDS))], list(KINDS))
        ax.set_title(f"{LABELS[m]} ({TITLES[g].split(' (')[0].lower()})", fontsize=9)
        ax.set_ylabel("% of held-out items (95% CI, seeds and items)")
        ax.set_ylim(0, 100)
    for (name, p), style in zip(results["setup"]["paper"].items(), (":", "--")):
        axes[1].axhline(100 * p["error_rate"], ls=style, color="black", lw=1, label=f"paper, {name} (all kinds)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, handles=axes[1].get_lines()[-2:], loc="upper right")
    fig.suptitle("Primary outcomes per question kind: base judge and GRPO variants (miniature)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
