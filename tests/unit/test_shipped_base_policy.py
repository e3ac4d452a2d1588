"""The base policy pjray ships: the build of the default recipe on this checkout (its hash covers
the recipe, the shipped judge's weights and the code of its examples), whole, small, with its
gates passed, and what `model.init=base_policy` resolves to."""

from __future__ import annotations

import json

from pjray.recipes.base_judge import SHIPPED_RECORD, shipped_record, weights_sha256
from pjray.recipes.base_policy import SHIPPED, BasePolicyRecipe, base_policy, recipe_hash


def test_the_shipped_policy_is_the_recipes_build_and_passed_its_gates():
    record = json.loads((SHIPPED / SHIPPED_RECORD).read_text())
    current = recipe_hash(BasePolicyRecipe(), shipped_record()["weights_sha256"])
    assert record["recipe_hash"] == current, (
        "the base policy recipe, the shipped judge or the code its hash covers changed: rebuild it "
        "(model.init=base_policy builds it into the cache, about 8 min) and ship it "
        "(pjray.recipes.base_policy.ship)"
    )
    assert weights_sha256(SHIPPED / "hf_model") == record["weights_sha256"]
    report = json.loads((SHIPPED / "report.json").read_text())
    assert report["recipe"] == json.loads(json.dumps(BasePolicyRecipe().to_dict()))
    assert report["passes"] == {"correct_in_band": True, "format": True, "judge_readable": True}
    assert report["judge_readable"] >= 0.95 and report["format"] >= 0.95
    cells = [v for k, v in report.items() if k.startswith("right/") and k.count("/") == 2]
    assert len(cells) == 12 and all(0.35 <= v <= 0.75 for v in cells)


def test_the_shipped_policy_is_small_and_what_model_init_names():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size <= 10 * 2**20, f"{size / 2**20:.1f} MB shipped"
    assert base_policy(None) == SHIPPED / "hf_model"  # no build, no Ray: the shipped one
