"""The bias study's statistics (`benchmarks/study_bias.py`): the hierarchical bootstrap over
seeds, then items, on synthetic data whose truth is known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study_bias.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study_bias", STUDY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["study_bias"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("study_bias", None)


def test_a_known_mean_lies_inside_its_interval(study) -> None:
    rng = np.random.default_rng(0)
    values = (rng.random((5, 400)) < 0.3).astype(float)  # 5 seeds, 400 items, true rate 0.3
    ci = study.hierarchical_bootstrap(values, reps=1000, seed=1)
    assert ci["lo"] < 0.3 < ci["hi"]
    assert ci["lo"] <= ci["mean"] <= ci["hi"] and ci["hi"] - ci["lo"] < 0.1


def test_the_interval_widens_when_seeds_disagree(study) -> None:
    rng = np.random.default_rng(0)
    items = rng.normal(0.5, 0.2, size=300)
    agree = np.tile(items, (5, 1))
    disagree = agree + np.array([-0.2, -0.1, 0.0, 0.1, 0.2])[:, None]  # the same mean, seeds apart
    narrow = study.hierarchical_bootstrap(agree, reps=1000, seed=1)
    wide = study.hierarchical_bootstrap(disagree, reps=1000, seed=1)
    assert narrow["mean"] == pytest.approx(wide["mean"])
    assert wide["hi"] - wide["lo"] > 2 * (narrow["hi"] - narrow["lo"])


def test_judges_share_item_draws_so_changes_are_paired(study) -> None:
    rng = np.random.default_rng(0)
    base = (rng.random(200) < 0.5).astype(float)
    one_seed = study.hierarchical_bootstrap(base[None], reps=500, seed=1)
    five_equal_seeds = study.hierarchical_bootstrap(np.tile(base, (5, 1)), reps=500, seed=1)
    assert one_seed == five_equal_seeds  # the same item draws whatever the number of seeds
    assert study.hierarchical_bootstrap(np.tile(base, (3, 1)), reps=500, seed=1, base=base) == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    better = np.tile(base, (3, 1))
    better[:, base == 0] = 1.0  # every seed fixes every miss
    change = study.hierarchical_bootstrap(better, reps=500, seed=1, base=base)
    assert 0 < change["lo"] <= change["mean"] <= change["hi"]


def test_undefined_items_are_left_out_and_seeds_are_counted(study) -> None:
    values = np.array([[1.0, np.nan, 0.0, 1.0], [np.nan, np.nan, np.nan, np.nan], [1.0, 1.0, 1.0, 1.0]])
    base = np.array([0.0, 0.0, 1.0, 1.0])
    assert study.seed_means(values) == [2 / 3, None, 1.0]
    # Paired over the items both define: seed 0 changes by (+1, -1, 0), no better; the
    # unreadable seed is not better either.
    assert study.seeds_improved(values, base, direction=1) == 1
    assert study.seeds_improved(values, base, direction=-1) == 0
    row = study.summarise(values, base, direction=1, reps=200)
    assert row["n"] == 7 and row["of"] == 12 and row["seeds_improved"] == 1
    assert row["lo"] <= row["mean"] <= row["hi"]
    assert study.hierarchical_bootstrap(np.full((2, 3), np.nan), reps=50, seed=1) == {"mean": None, "lo": None, "hi": None}
