"""`model.stage_dir`: the checkpoint is copied to a node's local disk once (`stage_checkpoint`),
whole or not at all, and reused until the source changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from pjray.staging import hub_revision, stage_checkpoint, stage_hub_snapshot, stage_on_nodes, staged_name

REPO = "owner/judge"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _checkpoint(root: Path) -> Path:
    src = root / "judge"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "tokenizer.json").write_text("{}")
    return src


def test_a_checkpoint_is_copied_once_then_reused(tmp_path: Path):
    src = _checkpoint(tmp_path)
    staged = Path(stage_checkpoint(str(src), str(tmp_path / "local")))
    assert staged.parent == tmp_path / "local" and staged.name == staged_name(src)
    for f in ("model.safetensors", "config.json", "sub/tokenizer.json"):
        assert (staged / f).read_bytes() == (src / f).read_bytes()
    stamp = (staged / "config.json").stat().st_mtime_ns
    time.sleep(0.01)
    assert stage_checkpoint(str(src), str(tmp_path / "local")) == str(staged)  # reused, not recopied
    assert (staged / "config.json").stat().st_mtime_ns == stamp
    # The copy was made beside it and renamed: no temporary is left.
    assert not [p for p in (tmp_path / "local").iterdir() if p.name.startswith(".")]


def test_a_changed_checkpoint_is_staged_anew(tmp_path: Path):
    src = _checkpoint(tmp_path)
    first = stage_checkpoint(str(src), str(tmp_path / "local"))
    (src / "config.json").write_text('{"a": 2, "b": 3}')
    second = stage_checkpoint(str(src), str(tmp_path / "local"))
    assert second != first and Path(second, "config.json").read_text() == '{"a": 2, "b": 3}'


def test_without_a_stage_dir_the_source_is_loaded_as_it_is(tmp_path: Path):
    src = _checkpoint(tmp_path)
    assert stage_on_nodes(str(src), "", ["node"]) == str(src)
    assert stage_on_nodes(REPO, "", ["node"]) == REPO


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding `REPO` at `COMMIT` as the hub client lays it out: blobs, a
    snapshot of links to them (weights, config, tokenizer, and files a model does not need) and
    `refs/main`."""
    root = tmp_path / "hub"
    repo = root / f"models--{REPO.replace('/', '--')}"
    files = {
        "config.json": b'{"model_type": "qwen2_vl"}',
        "model-00001-of-00002.safetensors": os.urandom(2048),
        "model-00002-of-00002.safetensors": os.urandom(1024),
        "tokenizer.json": b"{}",
        "merges.txt": b"a b",
        "chat_template.jinja": b"{{ messages }}",
        "pytorch_model.bin": os.urandom(512),
        "README.md": b"# judge",
    }
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{i}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / COMMIT


def test_a_hub_snapshot_is_staged_at_its_commit_with_the_model_files_only(hub_cache: Path, tmp_path: Path):
    """Offline, the commit is the cache's `main`; the staged copy holds the snapshot's weights,
    config and tokenizer as files (links followed), not the .bin duplicate or the README, under a
    name every node derives alike; a second staging reuses it without asking the cache."""
    assert hub_revision(REPO) == COMMIT
    staged = Path(stage_hub_snapshot(REPO, COMMIT, str(tmp_path / "local")))
    assert staged == tmp_path / "local" / f"owner--judge-{COMMIT[:16]}"
    kept = sorted(p.name for p in staged.iterdir() if not p.name.startswith("."))
    assert kept == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "merges.txt",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "tokenizer.json",
        ]
    )
    for name in kept:
        assert not (staged / name).is_symlink() and (staged / name).read_bytes() == (hub_cache / name).read_bytes()
    for link in hub_cache.iterdir():
        link.unlink()
    assert stage_hub_snapshot(REPO, COMMIT, str(tmp_path / "local")) == str(staged)


def test_a_hub_id_without_weights_or_not_cached_offline_fails_with_its_name(hub_cache: Path, tmp_path: Path):
    with pytest.raises(RuntimeError, match="owner/other: offline .* not in the local hub cache"):
        hub_revision("owner/other")
    for link in hub_cache.glob("*.safetensors"):
        link.unlink()
    with pytest.raises(RuntimeError, match=f"owner/judge at {COMMIT[:12]} has no .safetensors weights"):
        stage_hub_snapshot(REPO, COMMIT, str(tmp_path / "local"))
    assert not (tmp_path / "local").exists()
