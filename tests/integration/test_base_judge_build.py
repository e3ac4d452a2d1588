"""The base judge build at a reduced size (100 supervised steps instead of 2000): cached, its
supervised stage learned, the judge's tags written on held-out prompts, and its held-out report
written; and two builds of one recipe give the same weights (checked on a smaller recipe still,
which runs every stage: an unseeded draw or an order that changes shows in a few steps as in
many). The shipped judge's quality is tested in test_default_run_learns.py, its rebuild by
`pytest -m rebuild`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pjray.config import ModelConfig, RolloutConfig, load
from pjray.data.prompts import render_batch
from pjray.models.base_judge import BaseJudgeRecipe, judge_scenes
from pjray.recipes.base_judge import build_base_judge
from pjray.rollout.hf_engine import HFEngine

pytestmark = pytest.mark.slow

SMALL = BaseJudgeRecipe(vision_steps=40, vision_batch=16, sft_scenes=600, sft_steps=100, sft_batch=8)
SMALLER = BaseJudgeRecipe(vision_steps=4, vision_batch=8, sft_scenes=32, sft_steps=8, sft_batch=8)
HELD_OUT_SEED = 424242


def build(root: Path, lines: list[str], recipe: BaseJudgeRecipe = SMALL) -> Path:
    # The held-out report on fewer scenes than a real build's 64 (each kind of SMALL still
    # asked); the determinism check compares weights only, so its builds report on two.
    cfg = load(None, ["tracking.wandb=false"])
    return build_base_judge(cfg, recipe, log=lines.append, report_scenes=16 if recipe == SMALL else 2)


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
    report = json.loads((path.parent / "report.json").read_text())
    assert set(report["vision_cell_accuracy"]) == {"color", "shape", "size", "row", "col"}
    assert all(0.0 <= v <= 1.0 for v in report["vision_cell_accuracy"].values())
    assert set(report["probe_accuracy"]) == {"color", "shape", "size", "location"} | {
        f"question:{k}" for k in SMALL.kinds
    }
    assert set(report["batch_ranking"]) == {"greedy", "sampled"} and report["held_out_scenes"] == 16

    monkeypatch.setenv("PJRAY_CACHE", str(root))
    again: list[str] = []
    assert build(root, again) == path and not again  # from the cache, silently

    builds = []
    for cache in (tmp_path / "a", tmp_path / "b"):
        monkeypatch.setenv("PJRAY_CACHE", str(cache))
        builds.append(load_file(build(cache, [], SMALLER) / "model.safetensors"))
    a, b = builds
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "two builds of one recipe differ"


def test_supervised_judging_is_learned_and_writes_the_tags_on_held_out_prompts(built):
    path, _, _ = built
    sft = [json.loads(line) for line in (path.parent / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft) == SMALL.sft_steps
    first, last = (sum(r["sft/loss"] for r in rows) / len(rows) for rows in (sft[:10], sft[-10:]))
    assert last < 0.5 * first, (first, last)
    engine = HFEngine(str(path), ModelConfig(), RolloutConfig(max_new_tokens=48, temperature=1.0, top_k=1))
    rng = random.Random(0)
    batch = [render_batch(item, rng) for _, item in judge_scenes(24, HELD_OUT_SEED, SMALL)]
    texts = [c.text for c in engine.generate(batch, 1, 0)]
    tagged = [t.count("</think>") == 1 and "<answer>" in t.split("</think>")[1] for t in texts]
    assert sum(tagged) / len(tagged) >= 0.75, texts[:3]
