"""Async rollouts (`trainer.max_staleness`): the rollout workers generate the batches of later
steps while the learner trains. No sample older than k weight versions is trained on, whichever
side is slow; every sample carries the version that sampled it; a run interrupted with batches
in flight resumes at the same items, none trained twice and none skipped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import ray

from pjray.config import load
from pjray.recipes.training import training_inputs
from pjray.rl.trainer import Trainer, train
from pjray.signals import Interrupted

pytestmark = pytest.mark.slow

SPLIT = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "data.num_items=32",
    "data.image_size=64",
    "rollout.max_new_tokens=8",
    "trainer.prompts_per_step=2",
    "algo.group_size=4",
    "learner.micro_batch_size=4",
    "tracking.wandb=false",
    "trainer.export_hf=false",
    "rollout.backend=hf",
    "rollout.num_threads=1",
    "learner.num_threads=1",
    # A reward the random judge earns sometimes (a leading space), so groups differ and weights move.
    "reward.function=learnable_rewards:starts_with_space",
    "learner.lr=1e-2",
]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "slow_side",
    [
        # Three optimizer passes a step: the learner is the slow side.
        ["algo.ppo_epochs=3"],
        # Four times the tokens to generate and twice the groups of samples: the engine is.
        ["rollout.max_new_tokens=32", "algo.group_size=8"],
    ],
    ids=["slow_learner", "slow_engine"],
)
def test_no_sample_older_than_max_staleness_is_trained_on(ray_local, tmp_path, slow_side):
    k = 2
    run_dir = tmp_path / "run"
    cfg = load(
        overrides=[
            *SPLIT,
            *slow_side,
            f"trainer.run_dir={run_dir}",
            "trainer.steps=5",
            f"trainer.max_staleness={k}",
            "algo.rollout_is=token",
        ]
    )
    train(cfg, training_inputs(cfg))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        # Step t trains with the weights of step t - 1 on samples stamped by the engine with the
        # version it held: the batch of step t started k steps earlier (before step 1, from the
        # starting weights), so every sample is min(t - 1, k) versions old, never more.
        expected = min(m["step"] - 1, k)
        assert m["rollout/staleness_max"] == expected, m["step"]
        assert m["rollout/staleness_mean"] == expected, m["step"]
        # The learner trains on what stale weights sampled: their log-probs differ once the
        # weights have moved, and the IS weights correct for it.
        if expected:
            assert m["rollout/logprob_diff_max"] > 1e-4, m["step"]
            assert m["rollout_is/max"] != pytest.approx(1.0, abs=1e-6)


def test_a_run_stopped_with_batches_in_flight_resumes_at_the_same_items(ray_local, tmp_path):
    """ "Exact" with batches in flight: the checkpoint of step t records the data position after
    the items of step t, not after those the in-flight batches of steps t+1 .. t+k had taken; the
    resumed run takes those items again and generates them anew (with the checkpoint's weights,
    so their samples may differ from the lost ones). Every step trains on the same items as an
    uninterrupted run, and as the synchronous loop."""
    common = [*SPLIT, "trainer.steps=6", "trainer.save_every=3"]

    def consumed(run_dir: Path) -> list[float]:
        return [m["data/consumed"] for m in read_metrics(run_dir)]

    def run(*overrides: str) -> None:
        cfg = load(overrides=[*common, *overrides])
        train(cfg, training_inputs(cfg))

    whole = tmp_path / "whole"
    run(f"trainer.run_dir={whole}", "trainer.max_staleness=2")
    synchronous = tmp_path / "sync"
    run(f"trainer.run_dir={synchronous}")
    assert consumed(whole) == consumed(synchronous) == [2.0 * s for s in range(1, 7)]

    stopped = tmp_path / "stopped"
    cfg = load(overrides=[*common, f"trainer.run_dir={stopped}", "trainer.max_staleness=2"])

    def ctrl_c_at_step_3(step: int, metrics: dict) -> None:
        if step == 3:  # batches 4 and 5 are being generated
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted):
        train(cfg, training_inputs(cfg), on_step=ctrl_c_at_step_3)
    state = json.loads((stopped / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert state["sampler"]["consumed"] == 6  # three steps of two items, not the five in flight's
    train(cfg, training_inputs(cfg))
    metrics = read_metrics(stopped)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert consumed(stopped) == consumed(whole)
    # The resumed run's first batch was sampled by the checkpoint's own weights.
    assert metrics[3]["rollout/staleness_max"] == 0


def test_a_worker_killed_with_batches_in_flight_is_rebuilt_once(ray_local, tmp_path):
    """With k = 2, a worker killed with batches in flight: what it finished is kept, the next call
    to reach it rebuilds it (at the learner's weights), and a generation sent to the dead worker
    before the rebuild is sent again to the new one without rebuilding it a second time. Every
    step trains on its own items."""
    cfg = load(overrides=[*SPLIT, f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=4", "trainer.max_staleness=2"])
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        trainer.step = 1
        trainer.train_step()
        assert [b.step for b in trainer.collector.in_flight] == [2, 3]
        ray.kill(trainer.rollout.actors[0], no_restart=True)
        stale = []
        for step in (2, 3, 4):
            trainer.step = step
            metrics = trainer.train_step()
            assert metrics["data/consumed"] == 2 * step
            stale.append(metrics["rollout/staleness_max"])
        # Batches 2 and 3 were generated before the kill (step 1's sync waited for them) and are
        # kept, sampled by the starting weights. Batch 4 went to the dead worker at step 2; the
        # sync of step 2 found it dead and rebuilt it, and batch 4 was sent again when step 4
        # collected it, without a second rebuild, and sampled by step 3's weights.
        assert stale == [1, 2, 0]
        assert trainer.rollout.restarts == 1
        assert ray.get(trainer.rollout.actors[0].__ray_call__.remote(lambda w: w.weight_version)) == 4
    finally:
        trainer.shutdown()
