"""`pjray sweep`: grid expansion, validation before anything runs, results from metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pjray.cli import main
from pjray.config import ConfigError
from pjray.sweep import collect_results, plan_sweep, split_values, write_results

REPO = Path(__file__).resolve().parents[2]


def test_split_values_keeps_bracketed_lists():
    assert split_values("2,4, 8") == ["2", "4", "8"]
    assert split_values("[0,1],[2]") == ["[0,1]", "[2]"]


def test_grid_expands_to_the_cartesian_product(tmp_path):
    plan = plan_sweep(
        None, ["algo.group_size=2,4,8,16", "data.num_candidates=3,4,5", "trainer.steps=3"],
        name="gs", sweep_dir=tmp_path,
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
    plan = plan_sweep(str(REPO / "configs" / "demo.yaml"), ["algo.group_size=2,4"], ["trainer.steps=2"],
                      name="d", sweep_dir=tmp_path)
    assert [t.config.trainer.steps for t in plan.trials] == [2, 2]
    assert [t.config.learner.lr for t in plan.trials] == [1e-4, 1e-4]  # from demo.yaml


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
    return {"step": i, "reward/mean": reward, "rollout/frac_zero_std": zero, "reward/ranking_mean": ranking,
            "timing_s/step": seconds, "perf/total_num_tokens": tokens}


def test_results_from_metrics_files(tmp_path):
    plan = plan_sweep(None, ["algo.group_size=2,4", "data.num_candidates=3"], name="agg", sweep_dir=tmp_path)
    small, large = plan.trials
    write_metrics(Path(small.config.trainer.run_dir), [
        step(1, 0.1, 1.0, 0.2, 10.0, 100),
        step(2, 0.5, 0.5, 0.4, 2.0, 100),
        step(3, 0.3, 0.0, 0.6, 3.0, 100),
        # A resumed run logs step 3 again; the last record wins.
        step(3, 0.4, 0.0, 0.6, 3.0, 100),
    ])
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


@pytest.mark.slow
def test_two_trial_sweep_on_the_tiny_judge(tmp_path, capsys):
    """Two real trainings through the CLI on a local Ray cluster, one table at the end."""
    import ray

    sweep_dir = tmp_path / "sweep"
    try:
        code = main([
            "sweep", "--config", str(REPO / "configs" / "demo.yaml"), "--name", "tiny-gs",
            "--sweep-dir", str(sweep_dir),
            "data.num_items=16", "data.image_size=64", "rollout.max_new_tokens=8", "trainer.steps=2",
            "trainer.prompts_per_step=2", "learner.micro_batch_size=2", "trainer.export_hf=false",
            "tracking.wandb=false", "ray.num_cpus=2",
            "--grid", "algo.group_size=2,4",
        ])
    finally:
        ray.shutdown()
    assert code == 0, capsys.readouterr().err[-3000:]
    results = json.loads((sweep_dir / "results.json").read_text())["results"]
    assert [(r["trial"], r["status"], r["steps"], r["group_size"]) for r in results] == [
        ("group_size-2", "ok", 2, 2), ("group_size-4", "ok", 2, 4),
    ]
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in results)
    assert (sweep_dir / "plot_best_reward.png").is_file()
    assert (sweep_dir / "group_size-2" / "sweep_trial.json").is_file()
    assert "| 4 | 3 | 2 |" in (sweep_dir / "results.md").read_text()
    # A rerun finds both trials finished and only rewrites the results.
    assert main(["sweep", "--config", str(REPO / "configs" / "demo.yaml"), "--name", "tiny-gs",
                 "--sweep-dir", str(sweep_dir), "data.num_items=16", "data.image_size=64",
                 "rollout.max_new_tokens=8", "trainer.steps=2", "trainer.prompts_per_step=2",
                 "learner.micro_batch_size=2", "trainer.export_hf=false", "tracking.wandb=false",
                 "--grid", "algo.group_size=2,4"]) == 0
