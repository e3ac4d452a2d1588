"""The image budget (`model.min_pixels` / `model.max_pixels`): one resize rule for the learner's
processor and vLLM's (which gets the processor's own bounds), capping a checkpoint and never
raising it; and training rows whose prompt leaves no room for the response within
`rollout.max_model_len` are rejected with their length, never sent to an engine."""

from __future__ import annotations

import dataclasses
import io
import json

import PIL.Image
import pytest

from pjray.config import ConfigError, ImageBudget, load
from pjray.console import run_summary
from pjray.data.sources import Rows
from pjray.models.loading import image_token_count, load_processor
from pjray.models.tiny import build_tiny_judge
from pjray.ppjd.perturb import scene_items
from pjray.rl.items import drop_overlong


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    PIL.Image.new("RGB", (width, height), (200, 40, 40)).save(out, format="PNG")
    return out.getvalue()


def test_the_budget_caps_the_checkpoint_and_never_raises_it():
    assert ImageBudget().edges(3136, 12_845_056) == (3136, 12_845_056)  # 0, 0: the checkpoint's own
    assert ImageBudget(max_pixels=1_003_520).edges(3136, 12_845_056) == (3136, 1_003_520)
    assert ImageBudget(max_pixels=1_003_520).edges(2304, 2304) == (2304, 2304)  # the shipped judge: unchanged
    assert ImageBudget(200_704, 1_003_520).edges(3136, 12_845_056) == (200_704, 1_003_520)
    assert ImageBudget(min_pixels=200_704).edges(3136, 50_000) == (50_000, 50_000)  # lower bound never above the upper


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_images_of_any_size_stay_within_the_budget(tmp_path, arch):
    judge = build_tiny_judge(tmp_path / arch, arch=arch)
    own = load_processor(judge)
    factor = own.image_processor.patch_size * own.image_processor.merge_size
    sizes = [(97, 61), (640, 480), (1920, 1080), (3000, 400)]
    own_tokens = [image_token_count(own, png(w, h)) for w, h in sizes]
    capped = load_processor(judge, ImageBudget(max_pixels=6 * factor * factor))
    tokens = [image_token_count(capped, png(w, h)) for w, h in sizes]
    assert all(t <= 6 for t in tokens) and max(own_tokens) > 6
    assert capped.image_processor.size.longest_edge == 6 * factor * factor
    assert (
        load_processor(judge, ImageBudget(max_pixels=10**9)).image_processor.size == own.image_processor.size
    )  # never raised


def test_config_refuses_an_impossible_budget():
    assert load(None, []).model.image_budget == ImageBudget(0, 1_003_520)
    with pytest.raises(ConfigError, match="model.min_pixels=5 > model.max_pixels=4"):
        load(None, ["model.min_pixels=5", "model.max_pixels=4"])
    with pytest.raises(ConfigError, match=">= 0"):
        load(None, ["model.max_pixels=-1"])


def test_a_prompt_without_room_for_the_response_is_rejected_with_its_length(tmp_path):
    judge = build_tiny_judge(tmp_path / "judge")
    processor = load_processor(judge)
    items = scene_items(3, seed=0, image_size=64)
    long = dataclasses.replace(items[1], question=" ".join(["which colour is the object"] * 1000))
    rows = Rows("scenes", [items[0], long, items[2]])
    cfg = load(None, ["rollout.max_model_len=4096", "rollout.max_new_tokens=48"])
    kept = drop_overlong(rows, processor, cfg)
    assert [it.id for it in kept.rows] == [items[0].id, items[2].id]
    [reject] = kept.rejects
    assert reject.row_id == long.id
    assert "tokens + rollout.max_new_tokens=48 > rollout.max_model_len=4096" in reject.reason
    assert int(reject.reason.split("prompt of ")[1].split(" tokens")[0]) > 4048
    assert drop_overlong(Rows("scenes", items), processor, load(None, [])).rejects == []


def test_the_summary_counts_the_skipped_rows(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1, "data/rejected": 2.0}) + "\n")
    assert (
        run_summary(tmp_path, 1.0)[2]
        == f"  training rows skipped: 2 (each with its reason in {tmp_path / 'data_rejects.jsonl'})"
    )
