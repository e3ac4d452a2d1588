"""The base judge recipe end to end, at a reduced size: deterministic, cached, in the judge
format on held-out prompts, and a GRPO run from it that starts in the format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pjray.config import ModelConfig, RolloutConfig, load
from pjray.data.prompts import render_batch, render_score
from pjray.models.base_judge import BaseJudgeRecipe, build_base_judge, judge_scenes
from pjray.reward import judge_reward
from pjray.reward.parse import parse_score
from pjray.rl.rollout import HFEngine

pytestmark = pytest.mark.slow

SMALL = BaseJudgeRecipe(vision_steps=40, vision_batch=16, sft_scenes=600, sft_steps=200, sft_batch=8)
HELD_OUT_SEED = 424242


def build(root: Path, lines: list[str]) -> Path:
    cfg = load(None, ["tracking.wandb=false"])
    return build_base_judge(cfg, SMALL, log=lines.append)


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_local) -> tuple[Path, list[str], Path]:
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PJRAY_CACHE", str(root))
        lines: list[str] = []
        path = build(root, lines)
    return path, lines, root


def test_build_is_cached_and_deterministic(built, tmp_path: Path, monkeypatch):
    path, lines, root = built
    assert any("building the base judge once" in line for line in lines)
    assert (path / "COMPLETE").is_file() and (path / "preprocessor_config.json").is_file()
    assert json.loads((path.parent / "report.json").read_text())["vision_cell_accuracy"]["row"] > 0.5

    monkeypatch.setenv("PJRAY_CACHE", str(root))
    again: list[str] = []
    assert build(root, again) == path and not again  # from the cache, silently

    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path))
    other = build(tmp_path, [])
    a, b = load_file(path / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "two builds of one recipe differ"


def test_writes_the_judge_format_on_held_out_prompts(built):
    path, _, _ = built
    engine = HFEngine(str(path), ModelConfig(), RolloutConfig(max_new_tokens=48, temperature=1.0, top_k=1))
    rng = random.Random(0)
    batch, score = [], []
    for _, item in judge_scenes(24, HELD_OUT_SEED, SMALL):
        batch.append(render_batch(item, rng))
        score.append(render_score(item.question, item.image, item.candidates[0], item_id=item.id))
    texts = [c.text for c in engine.generate(batch + score, 1, 0)]
    batch_ok = [judge_reward(t, p.target, think_prefilled=True).format for t, p in zip(texts, batch)]
    score_ok = [parse_score(t, think_prefilled=True).format_ok for t in texts[len(batch) :]]
    assert sum(batch_ok) / len(batch_ok) >= 0.9, texts[:3]
    assert sum(score_ok) / len(score_ok) >= 0.9, texts[len(batch) : len(batch) + 3]


def test_grpo_from_the_base_judge_starts_in_the_format(built, tmp_path: Path):
    from pjray.rl.trainer import train

    path, _, _ = built
    cfg = load(None, [
        f"model.path={path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.prompts_per_step=4",
        "algo.group_size=4", "data.num_items=16", "tracking.wandb=false", "trainer.save_every=0",
        "learner.micro_batch_size=16", "ray.num_cpus=2",
    ])  # fmt: skip
    run_dir = train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward/format_mean"] >= 0.9
    assert rows[0]["rollout/frac_zero_std"] < 1.0  # the group's rewards differ: there is a signal
