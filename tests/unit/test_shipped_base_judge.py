"""The base judge pjray ships: built from the shipped recipe on this checkout (SHIPPED_INIT), whole,
small, with its four gates passed; and the order
in which `pjray train` finds a base judge (shipped, cached, built)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pjray.recipes import base_judge as artifact
from pjray.recipes.base_judge import (
    JUDGE_FILES,
    REBUILD,
    RECIPES,
    SHIPPED,
    SHIPPED_INIT,
    ShippedJudgeError,
    recipe_hash,
    shipped_record,
)

SHIPPED_RECIPE = RECIPES[SHIPPED_INIT]


def test_the_shipped_judge_is_the_recipes_build():
    record = shipped_record()  # every file there, the weights those recorded
    current = recipe_hash(SHIPPED_RECIPE)
    assert record["recipe_hash"] == current, (
        f"the base judge recipe or the code its hash covers changed (shipped: {record['recipe_hash']}, "
        f"this code: {current}); {REBUILD}"
    )
    report = json.loads((SHIPPED / "report.json").read_text())
    assert report["recipe"] == json.loads(json.dumps(SHIPPED_RECIPE.to_dict())), "report.json is of another recipe"


def test_the_shipped_judge_passed_its_gates():
    # The card (report.json) of a judge with an untaught part states its four gates, measured.
    gates = json.loads((SHIPPED / "report.json").read_text())["gates"]
    assert gates["passes"] == {"one_disposition": True, "sees": True, "taught_following": True, "untaught": True}
    measured = gates["measured"]
    assert min(measured["sees"].values()) >= gates["gates"]["sees"]
    assert min(measured["taught_following"].values()) >= gates["gates"]["taught_following"]
    assert measured["untaught_following"] <= gates["gates"]["untaught_following_max"]
    assert measured["untaught_pass_at_8"] >= gates["gates"]["untaught_pass_at_8"]


def test_the_shipped_judge_is_small():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size <= 10 * 2**20, f"{size / 2**20:.1f} MB shipped"


def test_the_shipped_judge_loads_and_is_a_qwen3_vl_judge():
    from pjray.models.loading import load_judge

    model, processor = load_judge(SHIPPED / "hf_model")
    assert model.config.model_type == "qwen3_vl" and processor.tokenizer is not None
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 5e6  # the recipe's ~2.2M parameters


@pytest.fixture
def fake_shipped(tmp_path, monkeypatch) -> Path:
    """A copy of the shipped judge in a temporary place, and an empty cache."""
    root = tmp_path / "shipped"
    shutil.copytree(SHIPPED, root)
    monkeypatch.setattr(artifact, "SHIPPED", root)
    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))
    return root


def test_base_judge_is_the_shipped_one_when_it_matches(fake_shipped):
    lines: list[str] = []
    assert artifact.base_judge(object(), log=lines.append) == fake_shipped / "hf_model" and not lines


def test_base_judge_prefers_a_cached_build_of_this_recipe_over_a_stale_shipped_one(fake_shipped, monkeypatch):
    record = json.loads((fake_shipped / "shipped.json").read_text())
    (fake_shipped / "shipped.json").write_text(json.dumps({**record, "recipe_hash": "0123456789abcdef"}))
    cached = artifact.cached_dir(SHIPPED_RECIPE) / "hf_model"
    cached.mkdir(parents=True)
    (cached / "COMPLETE").touch()
    assert artifact.base_judge(object()) == cached


def test_base_judge_builds_when_neither_matches_and_says_why(fake_shipped, monkeypatch):
    record = json.loads((fake_shipped / "shipped.json").read_text())
    (fake_shipped / "shipped.json").write_text(json.dumps({**record, "recipe_hash": "0123456789abcdef"}))
    calls = []
    monkeypatch.setattr(artifact, "build_base_judge", lambda cfg, recipe, log: calls.append(recipe) or Path("built"))
    lines: list[str] = []
    assert artifact.base_judge(object(), log=lines.append) == Path("built")
    assert calls == [SHIPPED_RECIPE]
    assert "built from another recipe (0123456789abcdef" in lines[0]


def test_a_damaged_shipped_judge_is_refused_with_how_to_rebuild(fake_shipped):
    weights = fake_shipped / "hf_model" / "model.safetensors"
    weights.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")  # e.g. a clone without the binary
    with pytest.raises(ShippedJudgeError, match="not those its record names.*pjray sft --ship"):
        shipped_record(fake_shipped)
    weights.unlink()
    with pytest.raises(ShippedJudgeError, match="lacks.*model.safetensors"):
        shipped_record(fake_shipped)


def test_ship_copies_a_finished_build_and_records_it(tmp_path):
    built = tmp_path / "cache" / "0123456789abcdef"
    (built / "hf_model").mkdir(parents=True)
    for name in JUDGE_FILES:
        shutil.copy2(SHIPPED / "hf_model" / name, built / "hf_model" / name)
    shutil.copy2(SHIPPED / "report.json", built / "report.json")
    with pytest.raises(ShippedJudgeError, match="no finished build"):
        artifact.ship(built, tmp_path / "out")
    (built / "hf_model" / "COMPLETE").touch()
    record = artifact.ship(built, tmp_path / "out")
    assert record["recipe_hash"] == "0123456789abcdef"
    assert shipped_record(tmp_path / "out") == record
    assert not (tmp_path / "out" / "hf_model" / "COMPLETE").exists()  # judge files only
