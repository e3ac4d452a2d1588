"""`pjray sweep`: grid expansion, validation before anything runs, the trials' Tune resources and
placement, results from metrics files. The sweeps that run on Tune are in tests/integration
(test_job_submit.py: trials at once on a two-node cluster, one failing; test_interrupt.py:
restore after Ctrl-C)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pjray.cli import main
from pjray.config import ConfigError, load
from pjray.placement import Placement, RoleResources, placement_plan
from pjray.rl.layout import choose_layout
from pjray.sweep import (
    DRIVER_BUNDLE,
    check_same_sweep,
    collect_results,
    error_line,
    param_space,
    plan_sweep,
    split_values,
    sweep_record,
    trial_resources,
    write_results,
)

REPO = Path(__file__).resolve().parents[2]


def test_split_values_keeps_bracketed_lists():
    assert split_values("2,4, 8") == ["2", "4", "8"]
    assert split_values("[0,1],[2]") == ["[0,1]", "[2]"]


def test_grid_expands_to_the_cartesian_product(tmp_path):
    plan = plan_sweep(
        None,
        ["algo.group_size=2,4,8,16", "data.num_candidates=3,4,5", "trainer.steps=3"],
        name="gs",
        sweep_dir=tmp_path,
    )
    assert len(plan.trials) == 12
    first = plan.trials[0]
    # Fixed (single-valued) axes stay out of the names.
    assert first.name == "group_size-2__num_candidates-3"
    assert (first.config.algo.group_size, first.config.data.num_candidates, first.config.trainer.steps) == (2, 3, 3)
    assert first.config.trainer.run_dir == str(tmp_path.resolve() / first.name)
    assert first.config.tracking.group == "gs"
    assert {t.name for t in plan.trials} == {
        f"group_size-{n}__num_candidates-{k}" for n in (2, 4, 8, 16) for k in (3, 4, 5)
    }


def test_shipped_config_and_overrides_apply_to_every_trial(tmp_path):
    plan = plan_sweep(
        str(REPO / "configs" / "qwen3vl_4b.yaml"),
        ["algo.group_size=8,16"],
        ["trainer.steps=2"],
        name="d",
        sweep_dir=tmp_path,
    )
    assert [t.config.trainer.steps for t in plan.trials] == [2, 2]
    assert [t.config.learner.lr for t in plan.trials] == [7.5e-7, 7.5e-7]  # from the shipped file


@pytest.mark.parametrize(
    "grid, message",
    [
        (["algo.group_sise=2,4"], "group_sise"),  # unknown key
        (["algo.group_size=1,2"], "algo.group_size"),  # invalid value in one trial
        (["data.num_candidates=3,9"], "data.num_candidates"),  # scenes carry at most 6
        (["algo.group_size"], "expected key=value"),
        (["algo.group_size=2,,4"], "empty value"),
        (["algo.group_size=2,2"], "repeated value"),
        (["algo.group_size=2", "algo.group_size=4"], "twice"),
        (["trainer.run_dir=a,b"], "trainer.run_dir"),
        (["tracking.group=x"], "tracking.group"),
    ],
)
def test_bad_grids_fail_before_anything_runs(grid, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan_sweep(None, grid, name="bad", sweep_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_failing_trial_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"trial group_size-1: algo.group_size"):
        plan_sweep(None, ["algo.group_size=2,1", "data.num_candidates=3"], name="bad", sweep_dir=tmp_path)


def test_cli_rejects_a_bad_grid_with_exit_code_2(tmp_path, capsys):
    code = main(["sweep", "--sweep-dir", str(tmp_path), "--grid", "algo.nope=1,2"])
    assert code == 2
    assert "algo.nope" in capsys.readouterr().err


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def step(i: int, reward: float, zero: float, ranking: float, seconds: float, tokens: float) -> dict:
    return {
        "step": i,
        "reward/mean": reward,
        "rollout/frac_zero_std": zero,
        "reward/ranking_mean": ranking,
        "timing_s/step": seconds,
        "perf/total_num_tokens": tokens,
    }


def test_results_from_metrics_files(tmp_path):
    plan = plan_sweep(None, ["algo.group_size=2,4", "data.num_candidates=3"], name="agg", sweep_dir=tmp_path)
    small, large = plan.trials
    write_metrics(
        Path(small.config.trainer.run_dir),
        [
            step(1, 0.1, 1.0, 0.2, 10.0, 100),
            step(2, 0.5, 0.5, 0.4, 2.0, 100),
            step(3, 0.3, 0.0, 0.6, 3.0, 100),
            # A resumed run logs step 3 again; the last record wins.
            step(3, 0.4, 0.0, 0.6, 3.0, 100),
        ],
    )
    results = collect_results(plan)
    r = results[0]
    assert (r.status, r.group_size, r.num_candidates, r.steps) == ("ok", 2, 3, 3)
    assert r.final_reward == pytest.approx(0.4)
    assert r.best_reward == pytest.approx(0.5)
    assert r.frac_zero_std_mean == pytest.approx(0.5)
    assert r.ranking_mean == pytest.approx(0.4)
    assert r.step_time_s == pytest.approx(3.0)  # median, not the warm-up step
    assert r.tokens_per_s == pytest.approx(300 / 15.0)
    # The second trial never ran.
    assert results[1].status == "missing" and results[1].final_reward is None

    paths = write_results(plan, results)
    table = paths["markdown"].read_text()
    assert "| group size | K | steps | final reward | best reward | mean frac_zero_std | ranking mean |" in table
    assert "| 2 | 3 | 3 | 0.400 | 0.500 | 0.50 | 0.400 | 3.00 | 20.0 | ok |" in table
    assert "| 4 | 3 | 0 | - |" in table
    saved = json.loads(paths["json"].read_text())
    assert saved["name"] == "agg" and saved["results"][0]["best_reward"] == pytest.approx(0.5)
    for key in ("final_reward", "frac_zero_std_mean", "step_time_s", "tokens_per_s", "reward_curves"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- trials on Ray Tune
def test_tune_configs_map_to_trials(tmp_path):
    from ray import tune

    plan = plan_sweep(None, ["algo.group_size=2,4", "data.num_candidates=3"], name="t", sweep_dir=tmp_path)
    assert param_space(plan) == {"algo.group_size": tune.grid_search(["2", "4"]), "data.num_candidates": "3"}
    assert plan.trial_for({"algo.group_size": "4", "data.num_candidates": "3"}).name == "group_size-4"
    with pytest.raises(KeyError, match="no trial has the values"):
        plan.trial_for({"algo.group_size": "8", "data.num_candidates": "3"})


@pytest.mark.parametrize(
    "overrides, roles",
    [
        (
            ["rollout.backend=hf", "rollout.num_workers=2", "reward.num_workers=2"],
            {"learner": range(1, 2), "rollout": range(2, 4), "reward": range(4, 6)},
        ),
        ([], {"learner": range(1, 2), "reward": range(2, 3)}),  # hybrid: the learner ranks generate
    ],
)
def test_a_trial_reserves_a_driver_bundle_and_exactly_its_trainings_bundles(overrides, roles):
    cfg = load(None, ["learner.num_cpus_per_rank=0.5", "ray.placement_strategy=SPREAD", *overrides])
    factory = trial_resources(cfg)
    bundles, ranges = placement_plan(choose_layout(cfg).roles(), first=1)
    assert factory.bundles == [DRIVER_BUNDLE, *bundles]
    assert factory.strategy == "SPREAD"
    assert ranges == roles
    assert bundles[0] == {"CPU": 0.5}


def test_the_trainer_places_its_actors_in_a_group_it_is_given(monkeypatch):
    """`Placement(group=..., first=1)`: the actors go to the given group's bundles from `first`
    on (a Tune trial's: bundle 0 is the trial driver's), the group must hold exactly the plan's
    bundles, and it is left to its owner at shutdown."""
    from pjray import placement as placement_module

    cfg = load(None, ["rollout.backend=hf", "rollout.num_workers=2"])
    roles = choose_layout(cfg).roles()
    bundles, _ = placement_plan(roles, first=1)
    group = SimpleNamespace(bundle_specs=[dict(DRIVER_BUNDLE), *bundles])
    placement = Placement(roles, strategy="PACK", group=group, first=1)
    assert placement.pg is group and not placement.owned
    assert [placement.strategy("rollout", i).placement_group_bundle_index for i in range(2)] == [2, 3]
    assert placement.strategy("learner", 0).placement_group_bundle_index == 1
    assert placement.strategy("reward", 0).placement_group is group
    removed = []
    monkeypatch.setattr(placement_module, "remove_placement_group", removed.append)
    placement.shutdown()
    assert removed == []

    too_small = SimpleNamespace(bundle_specs=[dict(DRIVER_BUNDLE), *bundles[:-1]])
    with pytest.raises(ValueError, match="this training needs"):
        Placement(roles, strategy="PACK", group=too_small, first=1)
    other_cpus = SimpleNamespace(bundle_specs=[dict(DRIVER_BUNDLE), {"CPU": 2.0}, *bundles[1:]])
    with pytest.raises(ValueError, match="this training needs"):
        Placement(roles, strategy="PACK", group=other_cpus, first=1)


def test_a_colocated_plan_shares_the_learner_bundles():
    roles = {
        "learner": RoleResources(2, 1.0, 0.5),
        "rollout": RoleResources(2, 0.5, 0.4, share_with="learner"),
        "reward": RoleResources(1, 0.25, 0.0),
    }
    bundles, ranges = placement_plan(roles, first=1)
    assert bundles == [{"CPU": 1.5, "GPU": 1.0}, {"CPU": 1.5, "GPU": 1.0}, {"CPU": 0.25}]
    assert ranges == {"learner": range(1, 3), "rollout": range(1, 3), "reward": range(3, 4)}


def test_a_sweep_dir_holds_one_sweep(tmp_path):
    plan = plan_sweep(None, ["trainer.seed=0,1"], name="a", sweep_dir=tmp_path)
    check_same_sweep(plan)  # nothing there yet
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_record(plan)))
    check_same_sweep(plan_sweep(None, ["trainer.seed=0,1"], name="a", sweep_dir=tmp_path))
    with pytest.raises(ConfigError, match="holds sweep 'a' with other trials"):
        check_same_sweep(plan_sweep(None, ["trainer.seed=0,1,2"], name="a", sweep_dir=tmp_path))
    with pytest.raises(ConfigError, match="holds sweep 'a' with other trials"):
        check_same_sweep(plan_sweep(None, ["trainer.seed=0,1"], ["trainer.steps=3"], name="a", sweep_dir=tmp_path))


def test_a_failed_trials_error_is_its_last_line():
    err = RuntimeError("Traceback (most recent call last):\n  File ...\nValueError: reward.function='m:f': no f\n")
    assert error_line(err) == "ValueError: reward.function='m:f': no f"
    assert error_line(RuntimeError("")) == "RuntimeError"


def test_max_concurrent_must_not_be_negative(tmp_path, capsys):
    code = main(["sweep", "--sweep-dir", str(tmp_path / "cli"), "--max-concurrent", "-1", "--grid", "trainer.seed=0,1"])
    assert code == 2
    assert "--max-concurrent -1" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
