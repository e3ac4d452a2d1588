"""Does a judge's perceptual bias reach the policy it rewards? The judge-reward study.

    pjray train                                                     # the trained judge: runs/demo/hf_model
    python benchmarks/study_judge_reward.py                         # 4 arms x 5 seeds
    python benchmarks/study_judge_reward.py --quick                 # every stage, 1 seed, a few steps
    python benchmarks/study_judge_reward.py --arms text --out OUT --earlier benchmarks/results/judge_reward/study.json

Declared before any run (keep this section as written; results that disagree are reported, not
re-declared):

The policy is the base policy (`model.init=base_policy`, pjray.recipes.base_policy): it answers
colour and size questions about one-object scenes in the style pjray's judges read and states a
wrong colour in about 45% of its answers, on every colour alike. Each arm trains it with GRPO
(task.kind=policy) for 80 steps of 8 groups of 6 answers (lr 1e-4, chosen by two pilots of the
rule arm at seed 0 on their training reward only: 1e-4 rose 0.57 -> 0.93 in 100 steps, 3e-4 0.63
-> 0.95) on the same rows (train content split), seeds 0-4 (`trainer.seed`), and differs only in
the reward:

| arm | reward |
|---|---|
| rule | the oracle: the final answer and every stated fact against the scene |
| trained | the judge the default run exports (`pjray train`: the shipped base judge after GRPO on PPJD) |
| base | the shipped base judge, whose checks of orange and purple were never taught (it guesses there) |
| control | the trained judge, its rewards permuted within each group (`reward.judge.shuffle_rewards`) |

Each judge ranks a group's answers three at a time, every subset under its three letter rotations
(`pjray.reward.judging`). The text-following judge of the issue (`model.init=base_judge`) is not an
arm here: its build is not shipped (25 minutes on 2 cores) and was not made for this study.

**Outcome**: on held-out scenes (the held-out content split, `pjray.eval.policy`: 8 questions per
kind x object colour, 4 answers each at temperature 1), the share of `right` answers (the final
answer is the reference and no wrong colour is stated) on the **untaught** colours (orange,
purple), the final policy minus the base policy on the same items, per seed.

**Hypotheses**: (1) the trained arm gains at least 20 points more than the base arm on untaught
colours (difference of the seed means); (2) the trained arm's mean gain is within 10 points of
the rule arm's; (3) the control's 95% t-interval over seeds includes 0. Secondary: the taught
colours, each kind, hallucinated colours, format; per-item exact McNemar tests between arms
(an item is right for an arm when most of its answers over the arm's seeds are right).

**Amendment** (written after the four arms' results, before any run of this arm): the fifth arm
of the issue, `text`: the text-following judge (`model.init=base_judge`'s recipe: it can judge by
the image and mostly judges by the answer's text; built into the cache on first use), unforced,
as the `base` arm otherwise. Same settings, seeds and evaluation, run on its own (`--arms text`,
its own output). Hypothesis (4): its mean gain on untaught colours is at least 10 points below
the trained arm's, and its hallucination rate is above the trained arm's.

Outcome of the amendment (2026-12-07): not run. The text-following judge that this code builds
(recipe 788cbfffe2f44576, 21 min) fails its own held-out report: greedy ranking format 0.375,
probe colour accuracy 0.109 (the shipped judge's: 1.0 and 1.0). A judge that cannot be read
would make this arm a second control, not the paper's biased judge.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pjray.config import ModelConfig, RolloutConfig, load  # noqa: E402
from pjray.eval.metrics import paired_test  # noqa: E402
from pjray.eval.policy import answer_verdicts, held_out_questions, summarize  # noqa: E402

ARMS = {
    "rule": ["reward.source=rule"],
    "trained": ["reward.source=judge", "reward.judge.model={trained}"],
    "base": ["reward.source=judge", "reward.judge.model=shipped"],
    "control": ["reward.source=judge", "reward.judge.model={trained}", "reward.judge.shuffle_rewards=true"],
    "text": ["reward.source=judge", "reward.judge.model={text}"],
}
DECLARED = ("rule", "trained", "base", "control")  # the default arms; `text` is the amendment's
SETTINGS = [
    "task.kind=policy",
    "task.answer_style=reasoned",
    "model.init=base_policy",
    "model.think_prefix=false",
    "data.scene_kinds=[color,size]",
    "data.num_items=256",
    "rollout.max_new_tokens=80",
    "reward.judge.max_new_tokens=64",
    "algo.group_size=6",
    "algo.kl_coef=0.01",
    "algo.prefilter_zero_std=false",
    "learner.lr=1e-4",
    "learner.micro_batch_size=24",
    "trainer.prompts_per_step=8",
    "trainer.save_every=0",
    "tracking.wandb=false",
]


def t_interval(values: list[float]) -> dict[str, float | None]:
    """Mean over seeds with its 95% t-interval (None with one seed)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return {"mean": float(x.mean()), "lo": None, "hi": None, "n": len(x)}
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return {"mean": float(x.mean()), "lo": float(x.mean() - half), "hi": float(x.mean() + half), "n": len(x)}


def evaluate(policy: str, qas: list, samples: int) -> list[dict]:
    from pjray.rollout.hf_engine import HFEngine

    engine = HFEngine(
        policy, ModelConfig(path=policy, think_prefix=False), RolloutConfig(backend="hf", max_new_tokens=96)
    )
    return answer_verdicts(engine, qas, samples, seed=0)


def run_arm(arm: str, seed: int, steps: int, judges: dict[str, str], out: Path) -> Path:
    """Train one arm at one seed into out/runs/<arm>_<seed> (`judges` fills the arm's judge
    path); returns its run directory."""
    from pjray.recipes.training import training_inputs
    from pjray.rl.trainer import train

    run_dir = out / "runs" / f"{arm}_{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [o.format(**judges) for o in ARMS[arm]]
    cfg = load(
        overrides=[
            *SETTINGS,
            *overrides,
            f"trainer.seed={seed}",
            f"trainer.steps={steps}",
            f"trainer.export_steps=[{steps // 2}]",
            f"trainer.run_dir={run_dir}",
        ]
    )
    train(cfg, training_inputs(cfg))
    return run_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--arms", default=",".join(DECLARED))
    p.add_argument("--trained-judge", default="runs/demo/hf_model")
    p.add_argument("--per-cell", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="1 seed, 4 steps, 2 questions a cell")
    p.add_argument("--out", default="benchmarks/results/judge_reward")
    p.add_argument(
        "--earlier",
        help="an earlier output of this script (its .json; its _items.parquet beside it) whose arms join "
        "this one's report: same settings, and the same base policy evaluation, or a refusal",
    )
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    if args.quick:
        seeds, args.steps, args.per_cell, args.samples = seeds[:1], 4, 2, 2
    trained = str(Path(args.trained_judge).resolve())
    if any("{trained}" in o for a in arms for o in ARMS[a]) and not (Path(trained) / "config.json").is_file():
        print(f"no trained judge at {trained}: run `pjray train` first (or give --trained-judge)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    from pjray.recipes.base_judge import RECIPES, base_judge
    from pjray.recipes.base_policy import base_policy

    cfg = load(overrides=SETTINGS)
    base = str(base_policy(cfg))
    judges = {"trained": trained}
    if "text" in arms:
        judges["text"] = str(base_judge(cfg, RECIPES["base_judge"]))
    qas = held_out_questions(args.per_cell, ("color", "size"))
    item_rows: list[dict[str, Any]] = []
    base_rows = evaluate(base, qas, args.samples)
    item_rows += [{**r, "arm": "base_policy", "seed": -1, "step": 0} for r in base_rows]
    results: dict[str, Any] = {"base_policy": summarize(base_rows), "runs": {}}
    earlier_arms: list[str] = []
    if args.earlier:
        earlier = json.loads(Path(args.earlier).read_text())
        same = {k: earlier["settings"][k] for k in ("seeds", "steps", "per_cell", "samples", "common")}
        now = {"seeds": seeds, "steps": args.steps, "per_cell": args.per_cell, "samples": args.samples}
        if same != {**now, "common": SETTINGS}:
            print(f"{args.earlier} was run with other settings: {same}", file=sys.stderr)
            return 2
        if earlier["base_policy"] != results["base_policy"]:
            print(f"{args.earlier} evaluated another base policy (or other held-out items)", file=sys.stderr)
            return 2
        earlier_arms = [a for a in earlier["settings"]["arms"] if a not in arms]
        results["runs"] = {k: v for k, v in earlier["runs"].items() if k.rsplit("_", 1)[0] in earlier_arms}
        rows = pq.read_table(Path(args.earlier).with_name(Path(args.earlier).stem + "_items.parquet")).to_pylist()
        item_rows += [r for r in rows if r["arm"] in earlier_arms]
    for arm in arms:
        for seed in seeds:
            t0 = time.perf_counter()
            run_dir = run_arm(arm, seed, args.steps, judges, out)
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            run = {"train_seconds": time.perf_counter() - t0, "steps": {}}
            for step, path in (
                (args.steps // 2, run_dir / f"hf_model_step_{args.steps // 2}"),
                (args.steps, run_dir / "hf_model"),
            ):
                rows = evaluate(str(path), qas, args.samples)
                item_rows += [{**r, "arm": arm, "seed": seed, "step": step} for r in rows]
                run["steps"][str(step)] = summarize(rows)
            keys = (
                "reward/mean",
                "reward/rule_mean",
                "reward/judge_mean",
                "judge/calls",
                "judge/unreadable",
                "judge/oracle_agreement",
                "judge/position_consistency",
                "judge/time_share",
            )
            run["train"] = {
                k: float(np.mean([m[k] for m in metrics if k in m])) for k in keys if any(k in m for m in metrics)
            }
            results["runs"][f"{arm}_{seed}"] = run
            print(
                f"{arm} seed {seed}: {json.dumps(run['steps'][str(args.steps)]['right/untaught'])} untaught right, "
                f"{time.perf_counter() - t0:.0f}s",
                flush=True,
            )
    arms = [*earlier_arms, *arms]
    results["summary"] = summary(results, arms, seeds, args.steps)
    results["paired"] = paired(item_rows, arms, args.steps)
    results["settings"] = {
        "seeds": seeds,
        "steps": args.steps,
        "per_cell": args.per_cell,
        "samples": args.samples,
        "arms": {a: ARMS[a] for a in arms},
        "earlier": args.earlier,
        "common": SETTINGS,
        "seconds": time.perf_counter() - started,
    }
    name = "quick" if args.quick else "study"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    pq.write_table(pa.Table.from_pylist(item_rows), out / f"{name}_items.parquet")
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, arms, out / f"{name}.png")
    print(markdown(results))
    return 0


def summary(results: dict[str, Any], arms: list[str], seeds: list[int], steps: int) -> dict[str, Any]:
    """Per arm: the final policy's rates and gains over the base policy, as t-intervals over seeds;
    the declared hypotheses' verdicts."""
    base = results["base_policy"]
    out: dict[str, Any] = {}
    for arm in arms:
        finals = [results["runs"][f"{arm}_{s}"]["steps"][str(steps)] for s in seeds]
        out[arm] = {
            key: t_interval([f[key] for f in finals])
            for key in (
                "right/untaught",
                "right/taught",
                "right/color",
                "right/size",
                "hallucinated",
                "format",
                "correct/all",
            )
        }
        out[arm]["gain_untaught"] = t_interval([f["right/untaught"] - base["right/untaught"] for f in finals])
        out[arm]["gain_taught"] = t_interval([f["right/taught"] - base["right/taught"] for f in finals])
    verdicts = {}
    if {"trained", "base"} <= set(out):
        verdicts["trained_beats_base_by_20"] = (
            out["trained"]["gain_untaught"]["mean"] - out["base"]["gain_untaught"]["mean"] >= 0.20
        )
    if {"trained", "rule"} <= set(out):
        verdicts["trained_within_10_of_rule"] = (
            abs(out["trained"]["gain_untaught"]["mean"] - out["rule"]["gain_untaught"]["mean"]) <= 0.10
        )
    if "control" in out and out["control"]["gain_untaught"]["lo"] is not None:
        c = out["control"]["gain_untaught"]
        verdicts["control_includes_0"] = c["lo"] <= 0 <= c["hi"]
    if {"trained", "text"} <= set(out):
        verdicts["text_below_trained_by_10_and_hallucinates_more"] = (
            out["trained"]["gain_untaught"]["mean"] - out["text"]["gain_untaught"]["mean"] >= 0.10
            and out["text"]["hallucinated"]["mean"] > out["trained"]["hallucinated"]["mean"]
        )
    out["hypotheses"] = verdicts
    return out


def paired(item_rows: list[dict[str, Any]], arms: list[str], steps: int) -> list[dict[str, Any]]:
    """Exact McNemar per pair of arms on the untaught items: an item is right for an arm when
    most of its final answers over seeds and samples are right."""
    right: dict[str, dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in item_rows:
        if r["part"] == "untaught" and (r["step"] == steps or r["arm"] == "base_policy"):
            right[r["arm"]][r["item"]].append(r["right"])
    majority = {arm: {i: sum(v) * 2 > len(v) for i, v in items.items()} for arm, items in right.items()}
    out = []
    names = ["base_policy", *arms]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a in majority and b in majority:
                common = sorted(set(majority[a]) & set(majority[b]))
                t = paired_test([majority[a][k] for k in common], [majority[b][k] for k in common])
                out.append(
                    {
                        "first": a,
                        "second": b,
                        "n": t.n,
                        "right_first": t.accuracy_first,
                        "right_second": t.accuracy_second,
                        "b": t.b,
                        "c": t.c,
                        "p_value": t.p_value,
                    }
                )
    return out


def _ci(c: dict[str, Any]) -> str:
    if c["lo"] is None:
        return f"{100 * c['mean']:+.0f} (one seed)"
    return f"{100 * c['mean']:+.0f} [{100 * c['lo']:+.0f}, {100 * c['hi']:+.0f}]"


def _pct(c: dict[str, Any]) -> str:
    if c["lo"] is None:
        return f"{100 * c['mean']:.0f}% (one seed)"
    return f"{100 * c['mean']:.0f}% [{100 * c['lo']:.0f}, {100 * c['hi']:.0f}]"


def markdown(results: dict[str, Any]) -> str:
    s, base = results["summary"], results["base_policy"]
    lines = [
        "| arm | untaught right | gain (points) | taught right | gain | hallucinated | format |",
        "|---|---|---|---|---|---|---|",
        f"| base policy | {100 * base['right/untaught']:.0f}% | | {100 * base['right/taught']:.0f}% | | "
        f"{100 * base['hallucinated']:.0f}% | {100 * base['format']:.0f}% |",
    ]
    for arm, c in s.items():
        if arm == "hypotheses":
            continue
        lines.append(
            f"| {arm} | {_pct(c['right/untaught'])} | {_ci(c['gain_untaught'])} | {_pct(c['right/taught'])} | "
            f"{_ci(c['gain_taught'])} | {_pct(c['hallucinated'])} | {_pct(c['format'])} |"
        )
    lines += [
        "",
        f"Hypotheses: {json.dumps(s['hypotheses'])}",
        "",
        "| first | second | n | right | right | b | c | p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in results["paired"]:
        lines.append(
            f"| {t['first']} | {t['second']} | {t['n']} | {100 * t['right_first']:.0f}% | "
            f"{100 * t['right_second']:.0f}% | {t['b']} | {t['c']} | {t['p_value']:.2g} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    base = results["base_policy"]
    for ax, part in zip(axes, ("untaught", "taught")):
        for arm in arms:
            runs = [r for key, r in results["runs"].items() if key.rsplit("_", 1)[0] == arm]
            steps = sorted({int(k) for r in runs for k in r["steps"]})
            y = [100 * base[f"right/{part}"]] + [
                100 * float(np.mean([r["steps"][str(st)][f"right/{part}"] for r in runs])) for st in steps
            ]
            ax.plot([0, *steps], y, marker="o", label=arm)
        ax.set_title(f"held-out right answers, {part} colours")
        ax.set_xlabel("step")
        ax.set_ylabel("% right (mean over seeds)")
        ax.set_ylim(0, 100)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
