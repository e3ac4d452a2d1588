"""A corrupt row never kills a training: it is skipped, listed with its file and row in the run
directory's rejects file, and counted in the metrics."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pjray.cli import main
from pjray.console import DATA_REJECTS
from pjray.data.sources import write_items
from pjray.ppjd.perturb import scene_items

pytestmark = pytest.mark.slow


def test_a_corrupt_image_is_skipped_and_counted(ray_local, tmp_path):
    items = scene_items(20, seed=0, num_candidates=3, image_size=64)
    items[7] = dataclasses.replace(items[7], image=items[7].image[:60])  # a truncated PNG
    data = write_items(items, tmp_path / "train.parquet")
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "model.init=tiny",
            "algo.prefilter_zero_std=false",
            "data.source=parquet",
            f"data.path={data}",
            "data.max_reject_fraction=0.1",
            "rollout.max_new_tokens=8",
            "trainer.prompts_per_step=10",
            "algo.group_size=2",
            "learner.micro_batch_size=4",
            "tracking.wandb=false",
            "trainer.export_hf=false",
            "trainer.steps=2",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert code == 0
    rejects = [json.loads(line) for line in (run_dir / DATA_REJECTS).read_text().splitlines()]
    assert rejects == [{"where": f"{data} row 7", "row_id": items[7].id, "reason": rejects[0]["reason"]}]
    assert rejects[0]["reason"].startswith("could not decode image")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["data/rejected"] == 1.0 for m in metrics)
    # 20 prompts over the 19 kept rows: every row was judged, so a kept bad row would have been.
    assert metrics[-1]["data/consumed"] == 20.0
