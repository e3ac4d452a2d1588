"""Does GRPO on PPJD reduce a judge's perceptual judgment bias? The miniature study.

    python benchmarks/study_bias.py            # the full study: 2 seeds, 240 items
    python benchmarks/study_bias.py --quick    # 1 seed, 120 items (58 min on 2 cores, tests beside it)
    python benchmarks/study_bias.py --smoke    # every stage on 8 items and 2 steps (the test suite's)

Judges: the base judge (`pjray.models.base_judge`, built once and cached) and the base judge
after GRPO at an equal budget (steps x prompts x group size) for each variant:

| variant | data | reward |
|---|---|---|
| levenshtein | PPJD tuples, K=3 (correct > perception error > perception + reasoning) | batch ranking, Levenshtein (the paper) |
| kendall | the same tuples | batch ranking, Kendall (the released code) |
| pairwise | PPJD pairs, K=2 (correct > perception error) | pairwise (the paper's pairwise baseline) |
| no_perception | tuples without perception errors (correct > 1 > 2 reasoning errors) | batch ranking, Levenshtein |

Every run is the whole system of the default run: `pjray.rl.trainer.train` (Ray Data PPJD build,
DeepSpeed learner with reference model that generates with the weights it trains, reward pool,
checkpoint, HF export).

Evaluation, on held-out scenes (their seeds are asserted disjoint from every scene the base
judge and the GRPO runs trained on), greedy decoding:
- the Mode (a)/(b) diagnosis (`pjray.eval.bias.diagnose`, the code of
  `pjray eval --bench perceptual_bias`): the score protocol on the correct and the perceptually
  wrong answer, and the probe question; error = score(wrong) >= score(correct);
- batch-ranking accuracy on held-out K=3 PPJD tuples (exact order, and correct answer first).
Each number has a 95% bootstrap confidence interval over items; each trained judge's change
from the base judge has a paired bootstrap interval (same items resampled for both).

Writes benchmarks/results/bias_study.{json,md,png} (or --out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pjray.config import Config, load
from pjray.data.prompts import render_batch
from pjray.data.scenes import sample_qa
from pjray.data.sources import read_items, write_items
from pjray.eval.bias import diagnose, diagnosis_item
from pjray.models.base_judge import BaseJudgeRecipe, build_base_judge, cache_root, training_scene_seeds
from pjray.ppjd.perturb import _scene_seed, ranked_item, scene_items
from pjray.reward import judge_reward
from pjray.types import JudgeItem

VARIANTS: dict[str, list[str]] = {
    "levenshtein": ["reward.metric=levenshtein"],
    "kendall": ["reward.metric=kendall"],
    "pairwise": ["reward.metric=levenshtein", "data.num_candidates=2"],
    "no_perception": ["reward.metric=levenshtein"],  # + its own parquet (reasoning errors only)
}
TRAIN_DATA_SEED = 0
EVAL_DIAGNOSIS_SEED, EVAL_RANKING_SEED = 7001, 7002  # held out: asserted below
PAPER = {  # Perception-Judge-Qwen3 vs its base (the paper's Table 1 / Section 5), for context
    "base": {"error_rate": 0.235, "mode_b_rate": 0.141},
    "grpo": {"error_rate": 0.143, "mode_b_rate": 0.076},
}


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    prompts_per_step: int
    group_size: int
    train_items: int
    eval_items: int
    seeds: tuple[int, ...]
    bootstrap: int = 2000


def default_budget(eval_items: int, seeds: tuple[int, ...]) -> Budget:
    """The default run's budget (configs/demo.yaml): its steps, prompts, group size and items."""
    cfg = load(None, [])
    return Budget(
        steps=cfg.trainer.steps, prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.algo.group_size,
        train_items=cfg.data.num_items, eval_items=eval_items, seeds=seeds,
    )  # fmt: skip


FULL = default_budget(eval_items=240, seeds=(0, 1))
QUICK = default_budget(eval_items=120, seeds=(0,))
# Every stage of the study on a few items and steps: what the test suite runs (its numbers mean
# nothing).
SMOKE = Budget(steps=2, prompts_per_step=4, group_size=4, train_items=8, eval_items=8, seeds=(0,), bootstrap=200)


# --------------------------------------------------------------------------- data


def train_items_no_perception(recipe: BaseJudgeRecipe, n: int) -> list[JudgeItem]:
    """The ablation's tuples: the same scenes and questions as the PPJD scene job's, with
    reasoning-error levels only."""
    kinds = recipe.kinds
    return [
        ranked_item(sample_qa(_scene_seed(TRAIN_DATA_SEED, i), recipe.image_size, kinds[i % len(kinds)], *recipe.objects), 3, perception=False)
        for i in range(n)
    ]


def eval_sets(recipe: BaseJudgeRecipe, n: int) -> tuple[list[Any], list[JudgeItem]]:
    kinds = list(recipe.kinds)
    diag = [diagnosis_item(it) for it in scene_items(n, EVAL_DIAGNOSIS_SEED, 3, recipe.image_size, kinds, recipe.objects)]
    ranking = scene_items(n, EVAL_RANKING_SEED, 3, recipe.image_size, kinds, recipe.objects)
    return diag, ranking


def scene_seed_of(item_id: str) -> int:
    return int(item_id.split("-")[1])  # scenes-<seed>-<kind>-<digest>


def assert_held_out(recipe: BaseJudgeRecipe, train_ids: list[str], diag: list[Any], ranking: list[JudgeItem]) -> int:
    trained = training_scene_seeds(recipe) | {scene_seed_of(i) for i in train_ids}
    held = {scene_seed_of(d.id) for d in diag} | {scene_seed_of(it.id) for it in ranking}
    overlap = trained & held
    assert not overlap, f"evaluation scenes seen in training: {sorted(overlap)[:5]}"
    return len(trained)


# --------------------------------------------------------------------------- judging


def make_generate(path: str, max_new_tokens: int = 96):
    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rl.rollout import HFEngine

    engine = HFEngine(path, ModelConfig(), RolloutConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_k=1), max_batch_prompts=16)

    def generate(prompts, seed):
        return [c.text for c in engine.generate(list(prompts), 1, seed)]

    return generate


def judge_items(generate, diag: list[Any], ranking: list[JudgeItem]) -> dict[str, np.ndarray]:
    """Per-item outcome arrays (nan = not defined for that item)."""
    _, records, _ = diagnose(generate, diag, seed=0)
    scored = np.array([r.correct_score is not None and r.wrong_score is not None for r in records])
    error = np.array([float(r.wrong_score >= r.correct_score) if s else np.nan for r, s in zip(records, scored)])
    probe = np.array([np.nan if r.probe_ok is None else float(r.probe_ok) for r in records])
    mode_a = np.where(np.isnan(error), np.nan, (error == 1) & (probe == 0)).astype(float)
    mode_b = np.where(np.isnan(error), np.nan, (error == 1) & (probe == 1)).astype(float)
    rng = random.Random(EVAL_RANKING_SEED)
    prompts = [render_batch(it, rng) for it in ranking]
    texts = generate(prompts, 0)
    exact, top1, fmt = [], [], []
    for p, t in zip(prompts, texts):
        r = judge_reward(t, p.target, think_prefilled=True)
        fmt.append(r.format)
        exact.append(float(r.format == 1.0 and r.pred == p.target))
        top1.append(float(r.format == 1.0 and r.pred is not None and r.pred[:1] == p.target[:1]))
    return {
        "error_rate": error, "mode_a_rate": mode_a, "mode_b_rate": mode_b, "probe_accuracy": probe,
        "ranking_exact": np.array(exact), "ranking_top1": np.array(top1), "ranking_format": np.array(fmt),
    }  # fmt: skip


def bootstrap_ci(values: np.ndarray, reps: int, seed: int, base: np.ndarray | None = None) -> dict[str, float]:
    """Mean (or mean difference from `base`, paired by item) with a 95% percentile interval."""
    rng = np.random.default_rng(seed)
    n = len(values)
    idx = rng.integers(0, n, size=(reps, n))

    def stat(v: np.ndarray) -> np.ndarray:
        sample = v[idx]
        return np.nanmean(sample, axis=1)

    if base is None:
        point, dist = float(np.nanmean(values)), stat(values)
    else:
        diff = values - base
        point, dist = float(np.nanmean(diff)), stat(diff)
    lo, hi = np.nanpercentile(dist, [2.5, 97.5])
    return {"mean": point, "lo": float(lo), "hi": float(hi), "n": int(np.sum(~np.isnan(values if base is None else values - base)))}


# --------------------------------------------------------------------------- training


def grpo_config(recipe: BaseJudgeRecipe, variant: str, seed: int, budget: Budget, run_dir: Path, judge: str, data: str) -> Config:
    """The embedded default run's config, from the base judge, at the study's budget."""
    overrides = [
        f"data.scene_kinds=[{','.join(recipe.kinds)}]", f"data.scene_objects=[{recipe.objects[0]},{recipe.objects[1]}]",
        f"model.path={judge}", f"trainer.run_dir={run_dir}", f"trainer.seed={seed}",
        f"trainer.steps={budget.steps}", f"trainer.prompts_per_step={budget.prompts_per_step}",
        f"algo.group_size={budget.group_size}", f"data.num_items={budget.train_items}",
        f"data.seed={TRAIN_DATA_SEED}", "tracking.wandb=false", "trainer.save_every=0",
        *VARIANTS[variant],
    ]  # fmt: skip
    if data:
        overrides += ["data.source=parquet", f"data.path={data}"]
    return load(None, overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller study (fewer steps, items and seeds)")
    ap.add_argument("--smoke", action="store_true", help="every stage on a few items and steps (a test, not a study)")
    ap.add_argument("--out", default="benchmarks/results", help="where bias_study.{json,md,png} go")
    ap.add_argument("--work", default="runs/bias_study", help="run directories of the GRPO judges")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args(argv)
    budget = SMOKE if args.smoke else QUICK if args.quick else FULL
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    started = time.perf_counter()
    work, out = Path(args.work).resolve(), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    cfg = load(None, [])
    recipe = BaseJudgeRecipe()
    t0 = time.perf_counter()
    judge = str(build_base_judge(cfg, recipe))
    base_build_s = time.perf_counter() - t0
    print(f"base judge: {judge} ({base_build_s:.0f}s)", flush=True)

    no_perception = work / "no_perception.parquet"
    write_items(train_items_no_perception(recipe, budget.train_items), no_perception)
    diag, ranking = eval_sets(recipe, budget.eval_items)

    from pjray.rl.trainer import train

    runs: dict[str, list[tuple[int, Path, float]]] = {}
    for variant in variants:
        for seed in budget.seeds:
            run_dir = work / f"{variant}-s{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # never resume a run of another base judge
            data = str(no_perception) if variant == "no_perception" else ""
            t0 = time.perf_counter()
            train(grpo_config(recipe, variant, seed, budget, run_dir, judge, data))
            runs.setdefault(variant, []).append((seed, run_dir, time.perf_counter() - t0))
            print(f"trained {variant} seed {seed} in {time.perf_counter() - t0:.0f}s", flush=True)

    train_ids = [it.id for rs in runs.values() for _, d, _ in rs for it in _train_items(d)]
    n_trained_scenes = assert_held_out(recipe, train_ids, diag, ranking)

    t0 = time.perf_counter()
    outcomes = {"base": judge_items(make_generate(judge), diag, ranking)}
    for variant, rs in runs.items():
        per_seed = [judge_items(make_generate(str(d / "hf_model")), diag, ranking) for _, d, _ in rs]
        # Seeds pooled item-wise: each item's outcome averaged over the seeds' judges.
        outcomes[variant] = {k: np.nanmean(np.stack([o[k] for o in per_seed]), axis=0) for k in per_seed[0]}
    eval_s = time.perf_counter() - t0

    results = summarise(outcomes, runs, budget)
    results["setup"] = {
        "budget": dataclasses.asdict(budget), "recipe": recipe.to_dict(),
        "base_judge": f"<pjray cache>/{Path(judge).relative_to(cache_root())}",  # no machine paths in results
        "base_build_seconds": base_build_s, "eval_seconds": eval_s,
        "eval_seeds": {"diagnosis": EVAL_DIAGNOSIS_SEED, "ranking": EVAL_RANKING_SEED},
        "held_out_check": f"{len(diag) + len(ranking)} evaluation scenes, none among {n_trained_scenes} training scenes",
        "wall_seconds": time.perf_counter() - started, "paper": PAPER,
    }  # fmt: skip
    (out / "bias_study.json").write_text(json.dumps(results, indent=2))
    (out / "bias_study.md").write_text(markdown(results))
    plot(results, out / "bias_study.png")
    print(markdown(results))
    print(f"wrote {out / 'bias_study.json'}, .md, .png in {time.perf_counter() - started:.0f}s")
    return 0


def _train_items(run_dir: Path) -> list[JudgeItem]:
    cfg = json.loads((run_dir / "config.json").read_text())
    if cfg["data"]["source"] == "parquet":
        return read_items(cfg["data"]["path"])
    return read_items(run_dir / "data" / "ppjd")


METRICS = ("error_rate", "mode_a_rate", "mode_b_rate", "probe_accuracy", "ranking_exact", "ranking_top1", "ranking_format")


def summarise(outcomes: dict[str, dict[str, np.ndarray]], runs: dict[str, Any], budget: Budget) -> dict[str, Any]:
    base = outcomes["base"]
    judges: dict[str, Any] = {}
    for name, o in outcomes.items():
        row: dict[str, Any] = {}
        for m in METRICS:
            row[m] = bootstrap_ci(o[m], budget.bootstrap, seed=1)
            if name != "base":
                row[m + "_change"] = bootstrap_ci(o[m], budget.bootstrap, seed=1, base=base[m])
        if name in runs:
            row["train_seconds"] = [round(s, 1) for _, _, s in runs[name]]
            row["reward_first_last"] = [_reward_first_last(d) for _, d, _ in runs[name]]
        judges[name] = row
    return {"judges": judges}


def _reward_first_last(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = max(1, min(3, len(rewards) // 2))
    return [round(float(np.mean(rewards[:k])), 3), round(float(np.mean(rewards[-k:])), 3)]


def _fmt(c: dict[str, float], pct: bool = True) -> str:
    if c["n"] == 0:
        return "- (none readable)"
    s = 100 if pct else 1
    return f"{c['mean'] * s:.1f} [{c['lo'] * s:.1f}, {c['hi'] * s:.1f}]"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| judge | scored items | error % | Mode (a) % | Mode (b) % | probe acc % | ranking exact % | correct first % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["judges"].items():
        cells = [_fmt(row[m]) for m in ("error_rate", "mode_a_rate", "mode_b_rate", "probe_accuracy", "ranking_exact", "ranking_top1")]
        scored = f"{row['error_rate']['n']} of {row['probe_accuracy']['n']}"  # both score prompts readable
        lines.append(f"| {name} | {scored} | " + " | ".join(cells) + " |")
    lines += ["", "Change from the base judge (paired bootstrap, percentage points):", "",
              "| judge | error | Mode (a) | Mode (b) | ranking exact | correct first |", "|---|---|---|---|---|---|"]
    for name, row in results["judges"].items():
        if name == "base":
            continue
        cells = [_fmt(row[m + "_change"]) for m in ("error_rate", "mode_a_rate", "mode_b_rate", "ranking_exact", "ranking_top1")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["judges"])
    metrics = [("error_rate", "error"), ("mode_a_rate", "Mode (a)"), ("mode_b_rate", "Mode (b)"), ("ranking_exact", "ranking exact")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        row = results["judges"][name]
        means = [100 * row[m]["mean"] for m, _ in metrics]
        err = [[100 * (row[m]["mean"] - row[m]["lo"]) for m, _ in metrics], [100 * (row[m]["hi"] - row[m]["mean"]) for m, _ in metrics]]
        ax.bar([i + j * width for i in range(len(metrics))], means, width, yerr=err, capsize=3, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(metrics))], [label for _, label in metrics])
    ax.set_ylabel("% of held-out items (95% bootstrap CI)")
    ax.set_title("Perceptual judgment bias before and after GRPO (miniature)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
