"""The PPJD dataset card: a YAML header `datasets` and the hub read (features, split sizes,
license, data files), and a text that says how the rows were built, with the manifest's counts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import datasets
import pytest
from huggingface_hub import DatasetCard

from pjray.config import ConfigError, PPJDConfig, load
from pjray.data.sources import PPJD_FEATURES, write_items
from pjray.ppjd.card import card_text, dataset_card, size_category
from pjray.ppjd.perturb import scene_items
from pjray.ppjd.pipeline import build_manifest, job_fingerprint, summary


def ppjd_output(out: Path, cfg: PPJDConfig) -> dict:
    """An output folder as the job leaves it: two shards, their stats, the manifest."""
    items = scene_items(7, seed=4, num_candidates=3, image_size=64)
    stats = [(0, items[:4], {"verify": 1}), (1, items[4:], {"vqa": 2})]
    for shard, kept, rejected in stats:
        write_items(kept, out / "ppjd" / f"shard-{shard:05d}.parquet")
        read = len(kept) + sum(rejected.values())
        (out / "stats").mkdir(parents=True, exist_ok=True)
        (out / "stats" / f"shard-{shard:05d}.json").write_text(
            json.dumps(
                {
                    "shard": shard,
                    "read": read,
                    "kept": len(kept),
                    "rejected": read - len(kept),
                    "rejected_by_stage": rejected,
                    "stage_seconds": {"perturb": 0.5},
                }
            )
        )
    return build_manifest(out, 2, 2, 10, 1.0, dataclasses.asdict(cfg))


def test_the_card_header_holds_features_splits_sizes_license_and_data_files(tmp_path):
    manifest = ppjd_output(tmp_path, PPJDConfig(license="cc-by-4.0"))
    path = tmp_path / "README.md"
    dataset_card(tmp_path, manifest).save(path)
    card = DatasetCard.load(path)
    assert card.data.license == "cc-by-4.0" and card.data.size_categories == "n<1K"
    info = card.data.dataset_info
    assert datasets.Features._from_yaml_list(info["features"]) == PPJD_FEATURES
    assert info["splits"] == [{"name": "train", "num_bytes": info["dataset_size"], "num_examples": 7}]
    assert manifest["counts"]["kept"] == 7 and info["download_size"] > 0
    assert card.data.configs == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "ppjd/*.parquet"}]}
    ]
    # `datasets` reads the folder through the card: the PPJD rows, with an Image column, and not the rejects.
    (tmp_path / "rejects").mkdir()
    (tmp_path / "rejects" / "shard-00000.parquet").write_bytes(b"not the dataset")
    rows = datasets.load_dataset(str(tmp_path), split="train", cache_dir=str(tmp_path / "cache"))
    assert rows.num_rows == 7 and rows.features == PPJD_FEATURES
    assert rows[0]["image"].size == (64, 64)


def test_the_card_text_says_how_the_rows_were_built_and_counts_each_stage(tmp_path):
    cfg = PPJDConfig(
        source="mmpr",
        paths=["data/MMPR/meta.json"],
        perturb_backend="llm",
        llm_model="Qwen/Qwen2.5-7B",
        vqa_backend="vlm",
        vlm_model="Qwen/Qwen2.5-VL-7B",
        decontam_files=["bench/pair.jsonl"],
        phash_max_distance=3,
    )
    manifest = ppjd_output(tmp_path, cfg)
    text = dataset_card(tmp_path, manifest).text
    assert "mmpr rows from meta.json" in text
    assert "`Qwen/Qwen2.5-7B`" in text and "`Qwen/Qwen2.5-VL-7B`" in text
    assert "1 evaluation file(s) (pair.jsonl): an image within 3 bits" in text
    counts = manifest["counts"]
    assert f"{counts['read']} rows read, {counts['kept']} kept, {counts['rejected']} rejected" in text
    assert (counts["read"], counts["kept"], counts["rejected"]) == (10, 7, 3)
    for stage, e in manifest["stages"].items():
        assert f"| {stage} | {e['in']} | {e['rejected']} | {e['out']} |" in text
    assert "| verify | 10 | 1 | 9 |" in text and "| vqa | 9 | 2 | 7 |" in text
    scenes = dataset_card(tmp_path, ppjd_output(tmp_path / "s", PPJDConfig())).text
    assert "256 synthetic scenes (96 px, 2-5 objects" in scenes and "no decontamination files" in scenes


def test_the_manifest_card_and_summary_carry_the_text_only_audit_of_every_written_row(tmp_path):
    manifest = ppjd_output(tmp_path, PPJDConfig())
    ranker = manifest["text_only_ranker"]
    # Both shards' rows, read back from the written files; nested tuples rank from the text alone.
    assert ranker["items"] == manifest["counts"]["kept"] == 7
    assert (ranker["correct_first"], ranker["exact"]) == (1.0, 1.0)
    assert (ranker["chance_correct_first"], ranker["chance_exact"]) == (1 / 3, 1 / 6)
    assert sum(k["items"] for k in ranker["by_kind"].values()) == 7
    text = dataset_card(tmp_path, manifest).text
    assert "## Can the text alone rank these tuples?" in text
    assert "| both rules | 100.0% | 100.0% |" in text and "| chance | 33.3% | 16.7% |" in text
    assert "| self-consistency | 50.0% | 50.0% |" in text and "| odd one out | 100.0% | 50.0% |" in text
    assert (
        "text-only ranker: correct-first 100.0% (chance 33.3%), exact 100.0% (chance 16.7%) over 7 tuples"
        in summary(manifest)
    )
    empty = build_manifest(tmp_path / "none", 0, 0, 0, 1.0, dataclasses.asdict(PPJDConfig()))
    assert empty["text_only_ranker"]["items"] == 0 and "| both rules | n/a | n/a |" in card_text(empty)


def test_size_categories_follow_the_hub_bounds():
    assert [size_category(n) for n in (0, 999, 1000, 54_321, 2_000_000)] == [
        "n<1K",
        "n<1K",
        "1K<n<10K",
        "10K<n<100K",
        "1M<n<10M",
    ]


def test_publishing_settings_do_not_change_which_rows_a_job_holds():
    assert job_fingerprint(PPJDConfig()) == job_fingerprint(PPJDConfig(license="mit", push_to_hub="me/ppjd"))
    assert load(overrides=["ppjd.push_to_hub=me/ppjd"]).ppjd.push_to_hub == "me/ppjd"
    with pytest.raises(ConfigError, match="ppjd.push_to_hub='ppjd': not a hub dataset id owner/name"):
        load(overrides=["ppjd.push_to_hub=ppjd"])
    with pytest.raises(ConfigError, match="ppjd.license: empty"):
        load(overrides=["ppjd.license=''"])
