"""The base policy: a small VL policy that answers colour and size questions about one-object
scenes in the style pjray's judges read (reasoning, then a "Final Answer:" line), and misreads the
object's colour often enough that a group of its answers holds right and wrong ones.

It is the shipped base judge (the same eyes, tokenizer and scene world) fine-tuned by `pjray sft`
on questions rendered as a policy sees them (`render_question`, task.answer_style=reasoned),
whose target answer states the true colour with probability `correct`, else a wrong colour drawn
uniformly from the other five, on every colour alike (taught and untaught by the judge): the
perception fact and everything it carries change together, as in PPJD's perception-only errors,
so a wrong answer is fluent. A downstream study asks whether a judge's reward moves it towards
the image. Shipped in pjray/assets/base_policy (`ship`), or built once into the cache, named by a
hash of the recipe, the shipped judge's weights and this module's example code; `report.json`
holds its gates (`policy_gates`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pjray.cache import cache_root
from pjray.data.prompts import render_question
from pjray.data.scenes import COLORS, Seen, answer_text, compose_answer, render, split_qas, true_view
from pjray.types import ChatExample

RECIPE_VERSION = 1
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "base_policy"


@dataclass(frozen=True)
class BasePolicyRecipe:
    kinds: tuple[str, ...] = ("color", "size")
    scenes: int = 3000  # supervised examples, one question each
    correct: float = 0.55  # the chance a target states the object's true colour
    steps: int = 1500
    batch: int = 16
    micro_batch: int = 16
    lr: float = 2e-3
    image_size: int = 96
    seed: int = 0
    # The gates (`policy_gates`): right answers per kind x colour (`pjray.eval.policy`), sampled
    # at temperature 1, in [low, high] on every colour; its format and the judge's readable
    # verdicts on groups of its answers at least `readable`.
    correct_band: tuple[float, float] = (0.35, 0.75)
    readable: float = 0.95

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _scene_seed(seed: int, index: int) -> int:
    return 7_000_000 + seed * 1_000_003 + index


def misread(view: tuple[Seen, ...], obj: int, color: str) -> tuple[Seen, ...]:
    """`view` with object `obj` seen in `color`."""
    return tuple(dataclasses.replace(s, color=color) if i == obj else s for i, s in enumerate(view))


def policy_examples(recipe: BasePolicyRecipe, split: str = "train") -> list[ChatExample]:
    """`recipe.scenes` questions (kinds cycled) on one-object scenes of `split`, each with its
    target answer: the true one with probability `recipe.correct`, else the answer of a view in
    which the object has another colour (drawn uniformly)."""
    rng = random.Random(f"pjray.base_policy:{recipe.seed}")
    qas = split_qas(
        recipe.scenes, lambda j: _scene_seed(recipe.seed, j), split, recipe.image_size, recipe.kinds, (1, 1)
    )
    out = []
    for qa in qas:
        view = true_view(qa.scene)
        if rng.random() >= recipe.correct:
            obj = qa.spec.subjects[0]
            wrong = rng.choice([c for c in COLORS if c != view[obj].color])
            view = misread(view, obj, wrong)
        steps, final = compose_answer(qa.spec, view)
        prompt = render_question(qa.question, render(qa.scene), item_id=f"policy-{qa.scene.seed}", reference=qa.final)
        out.append(ChatExample(prompt, answer_text(steps, final), task="answer"))
    return out


def recipe_hash(recipe: BasePolicyRecipe, judge_digest: str) -> str:
    """The recipe, its version, the judge it starts from (its weights' digest) and the code of
    `policy_examples` and `misread`, by content."""
    code = [hashlib.sha256(inspect.getsource(fn).encode()).hexdigest() for fn in (policy_examples, misread)]
    payload = {"recipe": recipe.to_dict(), "version": RECIPE_VERSION, "judge": judge_digest, "code": code}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def base_policy(cfg: Any, recipe: BasePolicyRecipe | None = None, log: Callable[[str], None] = print) -> Path:
    """The base policy of `recipe` (default: the one `model.init=base_policy` names): the one pjray
    ships (pjray/assets/base_policy) when it is that recipe's build, else built into the cache
    once; `cfg` supplies the Ray settings of a build's SFT stage."""
    from pjray.recipes.base_judge import SHIPPED as SHIPPED_JUDGE
    from pjray.recipes.base_judge import ShippedJudgeError, shipped_record

    recipe = recipe or BasePolicyRecipe()
    current = recipe_hash(recipe, shipped_record()["weights_sha256"])
    # The shipped record, its files and its weights' digest, checked as the judge's are.
    with contextlib.suppress(ShippedJudgeError):
        if shipped_record(SHIPPED)["recipe_hash"] == current:
            return SHIPPED / "hf_model"
    target = cache_root() / "base_policy" / current
    if (target / "hf_model" / "COMPLETE").exists():
        return target / "hf_model"
    return build_base_policy(cfg, recipe, str(SHIPPED_JUDGE / "hf_model"), target, log)


def ship(built: Path) -> dict[str, Any]:
    """Copies a finished build (`<cache>/base_policy/<hash>`) over the shipped base policy and
    writes its record, as the base judge's `ship` does; returns the record."""
    from pjray.recipes import base_judge

    return base_judge.ship(built, SHIPPED)


def build_base_policy(cfg: Any, recipe: BasePolicyRecipe, judge: str, target: Path, log: Callable[[str], None]) -> Path:
    """`pjray sft` of the judge `judge` on `policy_examples`, its gates in report.json."""
    from pjray.rl.sft import run_sft

    started = time.perf_counter()
    log(f"pjray: building the base policy once into {target} (a few minutes on 2 CPU cores), then cached")
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sft_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=judge, freeze_vision=True, dtype="float32", think_prefix=False),
        # The examples are handed to run_sft; the section gives the schedule only.
        sft=dataclasses.replace(cfg.sft, steps=recipe.steps, batch_size=recipe.batch, lr=recipe.lr),
        learner=dataclasses.replace(
            cfg.learner, num_ranks=1, num_cpus_per_rank=2, zero_stage=0, bf16=False, micro_batch_size=recipe.micro_batch
        ),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(work / "sft"), seed=recipe.seed),
        tracking=dataclasses.replace(cfg.tracking, wandb=False),
    )
    export = run_sft(sft_cfg, judge, policy_examples(recipe))
    gates = policy_gates(str(export), judge, recipe)
    log(f"pjray: the base policy's gates: {json.dumps(gates['passes'])}")
    report = {"recipe": recipe.to_dict(), **gates, "build_seconds": time.perf_counter() - started}
    (work / "report.json").write_text(json.dumps(report, indent=2))
    shutil.move(str(export), str(work / "hf_model"))
    (work / "hf_model" / "COMPLETE").touch()
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    log(f"pjray: base policy built in {time.perf_counter() - started:.0f}s: {target / 'hf_model'}")
    return target / "hf_model"


def policy_gates(policy: str, judge: str, recipe: BasePolicyRecipe, per_cell: int = 12, samples: int = 4) -> dict:
    """The base policy on held-out scenes (`pjray.eval.policy`: `per_cell` questions per kind x
    colour, `samples` answers each, temperature 1): its right rate per kind x colour (the final
    answer right, no wrong colour stated), its format rate, and the share of the judge's verdicts
    on its answers that can be read, each answer alone (the score protocol: the gate) and in
    threes (the ranking protocol, every subset under every letter rotation)."""
    from pjray.config import JudgeRewardConfig, ModelConfig, RolloutConfig
    from pjray.eval.policy import answer_verdicts, held_out_questions, summarize
    from pjray.reward.answer import shown_answer
    from pjray.rollout.hf_engine import HFEngine
    from pjray.rollout.judge_worker import JudgeRewardWorker
    from pjray.types import AnswerGroup

    qas = held_out_questions(per_cell, recipe.kinds, recipe.image_size, seed=recipe.seed)
    engine = HFEngine(
        policy, ModelConfig(path=policy, think_prefix=False), RolloutConfig(backend="hf", max_new_tokens=96)
    )
    rows = answer_verdicts(engine, qas, samples, seed=recipe.seed)
    summary = summarize(rows)
    answers: dict[int, list[str]] = defaultdict(list)
    for row in rows:
        answers[row["item"]].append(shown_answer(row["text"]))
    groups = [AnswerGroup(f"gate/{i}", qa.question, render(qa.scene), tuple(answers[i])) for i, qa in enumerate(qas)]
    readable = {}
    for protocol in ("score", "ranking"):
        worker = JudgeRewardWorker(JudgeRewardConfig(protocol=protocol), judge, ModelConfig())
        verdicts = worker.judge(groups, seed=recipe.seed)
        readable[protocol] = 1 - sum(v.unreadable for v in verdicts) / sum(v.calls for v in verdicts)
    cells = {
        key.removeprefix("right/"): v for key, v in summary.items() if key.startswith("right/") and key.count("/") == 2
    }
    low, high = recipe.correct_band
    return {
        **summary,
        # Each answer alone (score): whether the judge can read it; in threes (ranking): groups
        # whose answers agree make the shipped judge repeat a letter ("B > B > C").
        "judge_readable": readable["score"],
        "judge_readable_ranking": readable["ranking"],
        "passes": {
            "correct_in_band": all(low <= v <= high for v in cells.values()),
            "format": summary["format"] >= recipe.readable,
            "judge_readable": readable["score"] >= recipe.readable,
        },
    }
