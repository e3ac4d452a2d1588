"""The looking study's statistics (`benchmarks/study_looking.py`): t-intervals on seed means and
the hierarchical bootstrap over seeds, then items, on synthetic data whose truth is known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "study_looking.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study_looking", STUDY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["study_looking"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("study_looking", None)


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
    # With 5 seeds the t-interval on the seed means is the wider, honest one.
    t = study.t_interval(list(disagree.mean(axis=1)))
    assert t["hi"] - t["lo"] > wide["hi"] - wide["lo"]


def test_t_interval_by_hand(study) -> None:
    t = study.t_interval([0.2, 0.4, 0.6])  # sd 0.2, t(0.975, 2) = 4.3027
    assert t["mean"] == pytest.approx(0.4)
    assert t["hi"] - 0.4 == pytest.approx(4.3027 * 0.2 / np.sqrt(3), abs=1e-4)
    assert study.t_interval([0.7]) == {"mean": 0.7, "lo": None, "hi": None}
