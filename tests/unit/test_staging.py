"""`model.stage_dir`: the checkpoint is copied to a node's local disk once (`stage_checkpoint`),
whole or not at all, and reused until the source changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pjray.staging import stage_checkpoint, stage_on_nodes, staged_name


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


def test_without_a_stage_dir_or_a_directory_the_source_is_loaded_as_it_is(tmp_path: Path):
    src = _checkpoint(tmp_path)
    assert stage_on_nodes(str(src), "", ["node"]) == str(src)
    assert stage_on_nodes("Qwen/Qwen3-VL-4B-Thinking", str(tmp_path / "local"), ["node"]) == "Qwen/Qwen3-VL-4B-Thinking"
