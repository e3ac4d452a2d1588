"""Data in and out through Hugging Face `datasets`, end to end on CPU with no network: the PPJD
job's output loads as a dataset with its card, and `pjray train data.source=hf` trains from a
saved dataset, and from a renamed pair dataset streamed with a resume at the saved position."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import huggingface_hub
import pytest
from huggingface_hub import DatasetCard

from pjray.cli import main
from pjray.console import DATA_REJECTS
from pjray.data.sources import PPJD_FEATURES
from pjray.ppjd.perturb import scene_items

pytestmark = pytest.mark.slow

TINY = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "rollout.max_new_tokens=8",
    "trainer.prompts_per_step=4",
    "algo.group_size=2",
    "learner.micro_batch_size=4",
    "tracking.wandb=false",
    "trainer.export_hf=false",
]


@pytest.fixture(autouse=True)
def offline_with_own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sampler_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"global_step_{step}" / "trainer_state.json").read_text())["sampler"]


def test_ppjd_round_trip_through_datasets(ray_local, tmp_path):
    out = tmp_path / "ppjd"
    assert (
        main(
            [
                "ppjd",
                "ppjd.num_items=16",
                "ppjd.image_size=64",
                "ppjd.shard_size=8",
                "ppjd.license=apache-2.0",
                f"ppjd.output_dir={out}",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    kept = manifest["counts"]["kept"]
    assert kept >= 12

    rows = datasets.load_dataset("parquet", data_dir=str(out / "ppjd"), split="train")
    assert rows.features == PPJD_FEATURES and isinstance(rows.features["image"], datasets.Image)
    assert rows.num_rows == kept
    assert all(row["image"].size == (64, 64) for row in rows)  # every image decodes

    card = DatasetCard.load(out / "README.md")
    assert card.data.license == "apache-2.0"
    assert card.data.dataset_info["splits"][0] == {
        "name": "train",
        "num_examples": kept,
        "num_bytes": card.data.dataset_info["dataset_size"],
    }
    counts = manifest["counts"]
    assert f"{counts['read']} rows read, {kept} kept, {counts['rejected']} rejected" in card.text
    for stage, e in manifest["stages"].items():
        assert f"| {stage} | {e['in']} | {e['rejected']} | {e['out']} |" in card.text
    assert datasets.load_dataset(str(out), split="train").num_rows == kept  # the folder itself, through its card

    saved = tmp_path / "saved"
    rows.save_to_disk(saved)
    run_dir = tmp_path / "run"
    assert (
        main(["train", "data.source=hf", f"data.path={saved}", *TINY, "trainer.steps=2", f"trainer.run_dir={run_dir}"])
        == 0
    )
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[-1]["data/consumed"] == 8 and steps[-1]["data/rejected"] == 0
    assert (run_dir / DATA_REJECTS).read_text() == ""


def test_a_renamed_pair_dataset_streams_and_resumes_at_its_position(ray_local, tmp_path):
    """chosen/rejected pairs under other column names (data.columns), streamed: a checkpoint
    holds the stream's position and the resumed run reads on from it."""
    items = scene_items(12, seed=7, num_candidates=3, image_size=64)
    folder = tmp_path / "pairs"
    (folder / "img").mkdir(parents=True)
    lines = []
    for i, it in enumerate(items):
        (folder / "img" / f"{i}.png").write_bytes(it.image)
        lines.append(
            json.dumps(
                {
                    "uid": it.id,
                    "prompt": it.question,
                    "picture": f"img/{i}.png" if i != 2 else "img/gone.png",
                    "chosen": it.candidates[it.order[0]],
                    "rejected": it.candidates[it.order[-1]],
                }
            )
        )
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    common = [
        "data.source=hf",
        f"data.path={folder}",
        "data.streaming=true",
        "data.num_candidates=2",
        "data.columns.id=uid",
        "data.columns.question=prompt",
        "data.columns.image=picture",
        "data.max_reject_fraction=0.1",
        *TINY,
        f"trainer.run_dir={run_dir}",
    ]
    assert main(["train", *common, "trainer.steps=1"]) == 0
    first = sampler_state(run_dir, 1)
    # 4 prompts: rows 0..4, row 2 has no image.
    assert (first["consumed"], first["row"], first["rejected"], first["epoch"]) == (4, 5, 1, 0) and first["position"]

    assert main(["train", *common, "trainer.steps=2", "trainer.resume=auto"]) == 0
    second = sampler_state(run_dir, 2)
    assert (second["consumed"], second["row"], second["rejected"]) == (8, 9, 1)  # rows 5..8, after the saved position
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert [m["data/rejected"] for m in metrics(run_dir)] == [1, 1]
    listed = [json.loads(line) for line in (run_dir / DATA_REJECTS).read_text().splitlines()]
    assert [(r["where"], r["row_id"]) for r in listed] == [(f"{folder} [train] row 2", items[2].id)]
    assert listed[0]["reason"] == f"image 'img/gone.png' not found under {folder}"
