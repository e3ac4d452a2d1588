"""Adapter-only weight sync end to end on CPU: real Ray, real DeepSpeed (ZeRO-2, gloo), HF rollout
workers, a tiny random vision-language judge with LoRA (model.lora.sync=auto -> adapter).
The ZeRO-3 gather of the adapter is tested in tests/integration/test_learner.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import ray

from pjray.config import load
from pjray.recipes.training import training_inputs
from pjray.rl.trainer import Trainer
from pjray.sync.transports import AdapterTransport

pytestmark = pytest.mark.slow


def test_rollout_workers_take_the_adapter_alone(ray_local, tmp_path):
    """Two learner ranks train LoRA adapters; every sync sends the adapter alone (put in the
    object store once by rank 0), a small fraction of the merged weights.
    The HF rollout worker then samples from the learner's policy: the log-probs it returns equal
    the learner's (rollout/logprob_diff) on steps sampled after a sync, also after the worker
    was rebuilt and brought up to date with the adapter alone."""
    run_dir = tmp_path / "run"
    cfg = load(
        overrides=[
            "model.init=tiny",
            "algo.prefilter_zero_std=false",
            "data.num_items=16",
            "data.image_size=64",
            "tracking.wandb=false",
            f"trainer.run_dir={run_dir}",
            "trainer.steps=2",
            "trainer.prompts_per_step=2",
            "trainer.save_every=0",
            "trainer.export_hf=false",
            "reward.function=learnable_rewards:starts_with_space",
            "rollout.backend=hf",
            "rollout.num_workers=1",
            "rollout.max_new_tokens=6",
            "learner.num_ranks=2",
            "learner.zero_stage=2",
            "learner.micro_batch_size=2",
            "learner.lr=5e-2",
            "algo.group_size=4",
            "algo.kl_coef=0.01",
            "model.lora.rank=8",
            "model.lora.alpha=16",
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        transport = trainer.layout.transport
        assert isinstance(transport, AdapterTransport)
        worker = trainer.rollout.actors[0]
        base_sums = ray.get(worker.checksums.remote())
        trainer.run()
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["training/global_step"] for m in metrics] == [1, 2]
        # Step 2 was sampled by the adapter of step 1: the worker's log-probs are the learner's.
        assert all(0 <= m["rollout/logprob_diff_max"] < 1e-3 for m in metrics), metrics

        # What a sync sends: the adapter.
        ref, nbytes = ray.get([r.export_adapter.remote() for r in trainer.learners])[0]
        update = ray.get(ref)
        assert nbytes == update.nbytes == transport.sent_bytes
        assert update.rank == 8 and not any("visual" in name for name in update.tensors)
        assert all(t.numel() == t.shape[0] * t.shape[1] and 8 in t.shape for t in update.tensors.values())
        merged = sum(b.nbytes for b in ray.get(trainer.learners[0].weight_plan.remote(1 << 20)))
        assert nbytes < 0.5 * merged, (nbytes, merged)
        served = ray.get(worker.checksums.remote())
        assert served.keys() == base_sums.keys() and served != base_sums  # merged view, by HF names

        # A rebuilt worker loads the base judge and gets the adapter alone; step 3 is sampled by it.
        ray.kill(worker, no_restart=True)
        trainer.sync_weights()
        assert trainer.rollout.restarts == 1
        assert ray.get(trainer.rollout.actors[0].checksums.remote()) == served
        trainer.cfg = trainer.collector.cfg = dataclasses.replace(
            cfg, trainer=dataclasses.replace(cfg.trainer, steps=3)
        )
        trainer.run()
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["training/global_step"] == 3 and last["rollout/logprob_diff_max"] < 1e-3
    finally:
        trainer.shutdown()
