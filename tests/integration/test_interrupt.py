"""Ctrl-C and SIGTERM stop a real `pjray train` at a checkpoint; the resumed run's metrics have
every step once. Ctrl-C stops a `pjray sweep` on Ray Tune, and the same command resumes it. And an
error raised in a Ray worker reaches the user as its own one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from pjray.cli import main
from pjray.data.sources import DataError
from pjray.errors import EXIT_INPUT, explain

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "data.num_items=16",
    "data.image_size=64",
    "rollout.max_new_tokens=8",
    "trainer.prompts_per_step=2",
    "algo.group_size=2",
    "learner.micro_batch_size=4",
    "tracking.wandb=false",
    "trainer.export_hf=false",
    "ray.num_cpus=2",
]

# What an interrupt must never show.
NOISE = ("Traceback", "discovered a bug", "StackTrace", "KeyboardInterrupt")


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged(run_dir: Path, rows: int) -> Callable[[], bool]:
    metrics = run_dir / "metrics.jsonl"
    return lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows


def last_pjray_line(out: str) -> str:
    """pjray's closing line: actors' log lines, streamed by Ray's log monitor, may still arrive
    after it on the same console."""
    return [line for line in out.strip().splitlines() if line.startswith("pjray:")][-1]


def train_until(
    run_dir: Path, args: list[str], ready: Callable[[], bool], signum: int, command: str = "train"
) -> tuple[int, str]:
    """Run `pjray train` (or another `command`) in its own process group (as a terminal runs
    it), send `signum` once `ready()`, and return (exit code, output). SIGINT goes to the whole
    group, as Ctrl-C in a terminal sends it (the local Ray cluster's processes ignore it);
    SIGTERM to the driver, as `kill PID` and `ray job stop` send it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pjray", command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=run_dir.parent,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            break
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def test_an_interrupt_costs_no_logged_step_and_resume_logs_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, f"trainer.run_dir={run_dir}", "trainer.steps=8", "trainer.save_every=4"]

    code, out = train_until(run_dir, args, logged(run_dir, 2), signal.SIGINT)
    assert code == 130, out[-3000:]
    last = last_pjray_line(out)
    assert last.startswith("pjray: stopped by SIGINT at step "), out[-3000:]
    stopped = int(last.split("at step ")[1].split("/")[0])
    assert 2 <= stopped < 8 and last.endswith("run the same command with trainer.resume=auto")
    assert not [n for n in NOISE if n in out], out[-3000:]
    # The step under way when the signal came was finished and checkpointed with all before it.
    assert steps(run_dir) == list(range(1, stopped + 1))
    assert (run_dir / "checkpoints" / f"global_step_{stopped}" / "COMPLETE").is_file()
    before = (run_dir / "metrics.jsonl").read_text().splitlines()

    # `ray job stop` sends SIGTERM: the resumed run stops the same way, with 143.
    code, out = train_until(run_dir, args, logged(run_dir, stopped + 1), signal.SIGTERM)
    assert code == 143, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'global_step_{stopped}'}" in out
    last = last_pjray_line(out)
    assert last.startswith("pjray: stopped by SIGTERM at step "), out[-3000:]
    again = int(last.split("at step ")[1].split("/")[0])
    assert not [n for n in NOISE if n in out], out[-3000:]
    assert steps(run_dir) == list(range(1, again + 1))  # no step twice, none lost
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[:stopped] == before


def test_ctrl_c_during_set_up_is_one_line(tmp_path):
    """Ctrl-C while the actors start (the tiny judge is built just before): one line, 130, and
    no actor dying on a failed check with a C++ stack dump as Ray goes down under it."""
    run_dir = tmp_path / "run"
    code, out = train_until(
        run_dir, [*TINY, f"trainer.run_dir={run_dir}"], (run_dir / "base_model").exists, signal.SIGINT
    )
    assert code == 130, out[-3000:]
    assert last_pjray_line(out) == "pjray: interrupted (SIGINT)"
    assert not [n for n in NOISE if n in out], out[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()


def test_an_error_in_a_ray_worker_is_its_own_line(ray_local):
    @ray.remote
    def read_shard() -> None:
        raise DataError("shard-00003.parquet row 7: could not decode image")

    with pytest.raises(DataError) as err:
        ray.get(read_shard.remote())
    assert explain(err.value) == (EXIT_INPUT, "pjray: bad data: shard-00003.parquet row 7: could not decode image")


def test_an_error_in_an_actor_constructor_is_its_own_line(ray_local, tmp_path, capsys):
    """A judge directory without weights fails in the judge actor's constructor; the user sees
    pjray's line about the checkpoint, not Ray's account of a dead actor. (Text-only, so judged
    without images: with images the eval fails before any actor starts, naming eval.image.)"""
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    code = main(
        [
            "eval",
            "--judge",
            str(judge),
            "--bench",
            "perceptual_bias",
            "--output-dir",
            str(tmp_path / "out"),
            "eval.num_items=2",
            "eval.image=none",
        ]
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"pjray: bad model: {judge}: cannot load the model: "), last


def test_an_interrupted_sweep_resumes_without_rerunning_a_finished_trial(tmp_path):
    """Ctrl-C once the first of two trials (one at a time) has finished: Tune stops the second
    and saves the experiment, the command exits 130 saying how to resume; the same command again
    restores the experiment and runs only the unfinished trial."""
    sweep_dir = tmp_path / "sweep"
    args = [
        "--name",
        "resumable",
        "--sweep-dir",
        str(sweep_dir),
        "--max-concurrent",
        "1",
        *TINY,
        "trainer.steps=2",
        "--grid",
        "trainer.seed=0,1",
    ]
    records = [sweep_dir / f"seed-{i}" / "sweep_trial.json" for i in (0, 1)]

    code, out = train_until(sweep_dir, args, lambda: any(r.exists() for r in records), signal.SIGINT, command="sweep")
    assert code == 130, out[-4000:]
    assert "run the same command again to resume it" in last_pjray_line(out)
    finished = [r for r in records if r.exists()]
    assert len(finished) == 1, out[-4000:]
    first = finished[0]
    before = (first.read_text(), first.stat().st_mtime_ns, (first.parent / "metrics.jsonl").read_text())

    code, out = train_until(sweep_dir, args, lambda: False, signal.SIGINT, command="sweep")
    assert code == 0, out[-4000:]
    assert "restoring its Tune experiment" in out
    assert (first.read_text(), first.stat().st_mtime_ns, (first.parent / "metrics.jsonl").read_text()) == before
    assert all(r.exists() for r in records)
    results = json.loads((sweep_dir / "results.json").read_text())["results"]
    assert [(r["trial"], r["status"], r["steps"]) for r in results] == [("seed-0", "ok", 2), ("seed-1", "ok", 2)]
