"""`pjray sweep`: grid expansion, validation before anything runs, trials as concurrent Ray jobs
(against an in-memory job API), results from metrics files."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from pjray.cli import main
from pjray.config import ConfigError
from pjray.sweep import collect_results, plan_sweep, run_sweep, split_values, submission_id, write_results

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
    plan = plan_sweep(str(REPO / "configs" / "qwen3vl_4b.yaml"), ["algo.group_size=8,16"], ["trainer.steps=2"],
                      name="d", sweep_dir=tmp_path)
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
            "model.init=tiny", "data.num_items=16", "data.image_size=64", "rollout.max_new_tokens=8", "trainer.steps=2",
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
                 "--sweep-dir", str(sweep_dir), "model.init=tiny", "data.num_items=16", "data.image_size=64",
                 "rollout.max_new_tokens=8", "trainer.steps=2", "trainer.prompts_per_step=2",
                 "learner.micro_batch_size=2", "trainer.export_hf=false", "tracking.wandb=false",
                 "--grid", "algo.group_size=2,4"]) == 0


# --------------------------------------------------------------------------- trials as Ray jobs
class FakeJobs:
    """A job API in memory: a job ends on its `duration`-th status poll, writing the metrics a
    training would. Records submissions, stops and the most jobs in flight at once."""

    def __init__(self, duration: dict[str, int] | None = None, fail: tuple[str, ...] = (),
                 existing: dict[str, str] | None = None, interrupt_on_poll: int = 0):
        self.duration = duration or {}  # polls until a trial's job ends (default 2)
        self.fail = fail  # trial names whose jobs fail
        self.status = dict(existing or {})  # submission id -> status
        self.run_dirs: dict[str, Path] = {}
        self.polls: dict[str, int] = {}
        self.interrupt_on_poll = interrupt_on_poll  # raise KeyboardInterrupt on this poll (1-based)
        self.submitted: list[str] = []
        self.stopped: list[str] = []
        self.most_in_flight = 0

    def in_flight(self) -> int:
        return sum(s in ("PENDING", "RUNNING") for s in self.status.values())

    def list_jobs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(submission_id=i, status=s) for i, s in self.status.items()]

    def submit_job(self, *, entrypoint: str, submission_id: str, runtime_env: dict | None) -> str:
        assert submission_id not in self.status, f"{submission_id} submitted twice"
        assert entrypoint.startswith("pjray train ")
        run_dir = next(a for a in shlex.split(entrypoint) if a.startswith("trainer.run_dir="))
        self.run_dirs[submission_id] = Path(run_dir.partition("=")[2])
        self.status[submission_id] = "PENDING"
        self.submitted.append(submission_id)
        self.most_in_flight = max(self.most_in_flight, self.in_flight())
        return submission_id

    def get_job_status(self, job_id: str) -> str:
        if sum(self.polls.values()) + 1 == self.interrupt_on_poll:
            raise KeyboardInterrupt
        self.polls[job_id] = self.polls.get(job_id, 0) + 1
        if self.status[job_id] in ("PENDING", "RUNNING"):
            trial = job_id.split("--")[1]
            if self.polls[job_id] < self.duration.get(trial, 2):
                self.status[job_id] = "RUNNING"
            elif trial in self.fail:
                self.status[job_id] = "FAILED"
            else:
                self.status[job_id] = "SUCCEEDED"
                self.run_dirs[job_id].mkdir(parents=True, exist_ok=True)
                (self.run_dirs[job_id] / "metrics.jsonl").write_text(json.dumps(step(1, 0.5, 0.0, 0.5, 1.0, 10)))
        return f"JobStatus.{self.status[job_id]}"

    def get_job_logs(self, job_id: str) -> str:
        return "Traceback ...\nValueError: the trial broke"

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        self.status[job_id] = "STOPPED"
        return True


def seeds_plan(tmp_path: Path, n: int):
    return plan_sweep(None, [f"trainer.seed={','.join(map(str, range(n)))}"], name="jobs", sweep_dir=tmp_path)


def test_jobs_run_at_most_n_at_once_and_each_trial_once(tmp_path):
    plan = seeds_plan(tmp_path, 5)
    jobs = FakeJobs(duration={"seed-0": 5, "seed-1": 2, "seed-2": 3, "seed-3": 1, "seed-4": 2})
    results = run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=2, client=jobs)
    assert jobs.most_in_flight == 2
    assert sorted(jobs.submitted) == [f"jobs--seed-{i}" for i in range(5)]
    assert [r.status for r in results] == ["ok"] * 5
    record = json.loads((tmp_path / "seed-3" / "sweep_trial.json").read_text())
    assert (record["trial"], record["job"]) == ("seed-3", "jobs--seed-3")
    assert json.loads((tmp_path / "sweep.json").read_text())["max_concurrent"] == 2


def test_a_failed_job_is_reported_and_the_others_finish(tmp_path):
    plan = seeds_plan(tmp_path, 3)
    jobs = FakeJobs(fail=("seed-0",))
    results = run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=3, client=jobs)
    assert [r.status for r in results] == ["failed", "ok", "ok"]
    assert results[0].error.startswith("RuntimeError: Ray job jobs--seed-0 ended FAILED")
    assert "the trial broke" in results[0].error
    assert not (tmp_path / "seed-0" / "sweep_trial.json").exists()


def test_a_rerun_skips_finished_trials_and_resubmits_ended_jobs(tmp_path):
    plan = seeds_plan(tmp_path, 2)
    first = FakeJobs(fail=("seed-1",))
    run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=2, client=first)
    # The cluster remembers both jobs; only the failed trial runs again, under a fresh id.
    again = FakeJobs(existing=first.status)
    results = run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=2, client=again)
    assert again.submitted == ["jobs--seed-1--try2"]
    assert [r.status for r in results] == ["ok", "ok"]
    third = FakeJobs(existing={**again.status, "jobs--seed-1--try2": "FAILED"})
    (tmp_path / "seed-1" / "sweep_trial.json").unlink()
    results = run_sweep(plan, submit="http://head:8265", poll_s=0, client=third)
    assert third.submitted == ["jobs--seed-1--try3"]
    assert [r.status for r in results] == ["ok", "ok"]


def test_a_job_still_running_from_an_earlier_run_is_waited_for(tmp_path):
    plan = seeds_plan(tmp_path, 2)
    jobs = FakeJobs(existing={"jobs--seed-0": "FAILED", "jobs--seed-0--try2": "RUNNING", "other--seed-1": "RUNNING"})
    jobs.run_dirs["jobs--seed-0--try2"] = tmp_path / "seed-0"
    results = run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=2, client=jobs)
    assert jobs.submitted == ["jobs--seed-1"]  # another sweep's job is not this trial's
    assert jobs.polls["jobs--seed-0--try2"] >= 1
    assert [r.status for r in results] == ["ok", "ok"]
    assert json.loads((tmp_path / "seed-0" / "sweep_trial.json").read_text())["job"] == "jobs--seed-0--try2"


def test_ctrl_c_stops_the_jobs_in_flight(tmp_path):
    plan = seeds_plan(tmp_path, 4)
    jobs = FakeJobs(duration={"seed-0": 1, "seed-1": 3, "seed-2": 9}, interrupt_on_poll=6)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, submit="http://head:8265", poll_s=0, max_concurrent=2, client=jobs)
    # Polls: seed-0 ends (1), seed-1 (2); seed-2 takes seed-0's place; seed-1 (3), seed-2 (4);
    # seed-1 ends (5); Ctrl-C comes on the next poll, of seed-2, the only job in flight.
    assert jobs.submitted == ["jobs--seed-0", "jobs--seed-1", "jobs--seed-2"]
    assert jobs.stopped == ["jobs--seed-2"]
    assert [p.parent.name for p in sorted(tmp_path.glob("*/sweep_trial.json"))] == ["seed-0", "seed-1"]
    assert not (tmp_path / "results.json").exists()


def test_submission_ids_are_readable_and_safe():
    assert submission_id("gs 4/8", "group_size-4__num_candidates-3") == "gs_4_8--group_size-4__num_candidates-3"
    assert submission_id("gs", "seed-0", 3) == "gs--seed-0--try3"


def test_concurrent_trials_need_submit(tmp_path, capsys):
    plan = seeds_plan(tmp_path, 2)
    with pytest.raises(ConfigError, match="--max-concurrent 2 needs --submit"):
        run_sweep(plan, max_concurrent=2)
    code = main(["sweep", "--sweep-dir", str(tmp_path / "cli"), "--max-concurrent", "2", "--grid", "trainer.seed=0,1"])
    assert code == 2
    assert "needs --submit" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
