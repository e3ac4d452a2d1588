"""The PPJD shards kept per machine for training's scene data: keyed by every setting that decides
the rows and by pjray's code, written whole, restored only into a directory without shards."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from test_ppjd_card import ppjd_output

from pjray.config import PPJDConfig
from pjray.ppjd import cache
from pjray.ppjd.pipeline import build_manifest


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_finished_job_is_kept_and_restored_into_a_new_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))
    cfg = PPJDConfig(source="scenes", num_items=7, output_dir=str(tmp_path / "run1"))
    manifest = ppjd_output(tmp_path / "run1", cfg)
    entry = cache.store(cfg, tmp_path / "run1", manifest)
    assert entry is not None and entry.parent == tmp_path / "cache" / "ppjd"
    assert cache.store(cfg, tmp_path / "run1", manifest) is None  # kept once
    assert not list(entry.parent.glob("*.tmp-*"))

    other_dir = dataclasses.replace(cfg, output_dir=str(tmp_path / "run2"))  # not part of the key
    assert cache.restore(other_dir, tmp_path / "run2") == entry
    shards = {k: v for k, v in _files(tmp_path / "run1").items() if k.split("/")[0] in cache.SHARD_DIRS}
    assert _files(tmp_path / "run2") == shards


def test_other_settings_or_other_code_are_other_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))
    cfg = PPJDConfig(source="scenes", num_items=7)
    assert cache.entry_dir(cfg) == cache.entry_dir(dataclasses.replace(cfg, output_dir="elsewhere", llm_workers=4))
    assert cache.entry_dir(cfg) != cache.entry_dir(dataclasses.replace(cfg, seed=1))
    assert cache.entry_dir(cfg) != cache.entry_dir(dataclasses.replace(cfg, construction="independent"))
    before = cache.entry_dir(cfg)
    monkeypatch.setattr(cache, "code_hash", lambda: "another version of pjray")
    assert cache.entry_dir(cfg) != before


def test_nothing_is_restored_over_shards_or_from_an_unfinished_job(tmp_path, monkeypatch):
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))
    cfg = PPJDConfig(source="scenes", num_items=7)
    manifest = ppjd_output(tmp_path / "run1", cfg)
    unfinished = build_manifest(tmp_path / "run1", 3, 2, 10, 1.0, dataclasses.asdict(cfg))  # 2 of 3 shards
    assert cache.store(cfg, tmp_path / "run1", unfinished) is None
    assert cache.restore(cfg, tmp_path / "run2") is None  # nothing kept yet
    assert cache.store(cfg, tmp_path / "run1", manifest) is not None

    ppjd_output(tmp_path / "resumed", dataclasses.replace(cfg, seed=9))  # a run's own shards
    before = _files(tmp_path / "resumed")
    assert cache.restore(cfg, tmp_path / "resumed") is None
    assert _files(tmp_path / "resumed") == before
    assert json.loads((cache.entry_dir(cfg) / "stats" / "shard-00000.json").read_text())["kept"] == 4


def test_nothing_is_restored_into_a_directory_where_a_job_started(tmp_path, monkeypatch):
    """A job killed before its first shard leaves only its job file: the directory is that job's
    (or, of another config, refused by run_ppjd), and nothing is copied into it."""
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))
    cfg = PPJDConfig(source="scenes", num_items=7)
    assert cache.store(cfg, tmp_path / "run1", ppjd_output(tmp_path / "run1", cfg)) is not None
    started = tmp_path / "started"
    started.mkdir()
    (started / "job.json").write_text(json.dumps({"seed": 9}))
    assert cache.restore(cfg, started) is None
    assert _files(started) == {"job.json": b'{"seed": 9}'}
