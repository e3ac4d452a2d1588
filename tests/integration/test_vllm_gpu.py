"""The GPU production path: vLLM rollouts of a tiny VLM judge, colocated (CUDA IPC + sleep mode)
and split (NCCL broadcast), with a DeepSpeed learner. Skipped without CUDA or without vLLM.

After three GRPO steps on the same two images (so a stale encoder cache after a sync would show
in every step's logprob_diff) the engine must serve the learner's weights: its logprobs of a
fixed continuation equal the learner's. `benchmarks/gpu_smoke.sh` runs the same layouts with timings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

vllm = pytest.importorskip("vllm", reason="vllm is not importable here (install pjray[gpu] on a GPU machine)")

import ray  # noqa: E402

from pjray.cluster import actor_env  # noqa: E402
from pjray.config import load  # noqa: E402
from pjray.models.loading import render_chat  # noqa: E402
from pjray.recipes.training import training_inputs  # noqa: E402
from pjray.rl.trainer import Trainer  # noqa: E402
from pjray.types import Experience, JudgePrompt  # noqa: E402

COMMON = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "model.tiny_arch=qwen2_vl",
    "rollout.backend=vllm",
    "rollout.device=cuda",
    "rollout.max_model_len=2048",
    "rollout.max_new_tokens=32",
    "data.num_items=2",
    "data.image_size=64",
    "algo.group_size=4",
    "trainer.prompts_per_step=2",
    "trainer.steps=3",
    "trainer.save_every=0",
    "trainer.export_hf=false",
    "learner.micro_batch_size=4",
    "learner.lr=0.05",
    "tracking.wandb=false",
]
COLOCATED = [
    "learner.num_ranks=1",
    "rollout.num_workers=1",
    "rollout.colocate=true",
    "learner.num_gpus_per_rank=0.5",
    "rollout.num_gpus_per_worker=0.4",
    "rollout.gpu_memory_utilization=0.3",
    "trainer.sync_backend=ipc",
    "learner.offload_during_generation=true",
]
SPLIT = [
    "learner.num_ranks=1",
    "rollout.num_workers=1",
    "learner.num_gpus_per_rank=1",
    "rollout.num_gpus_per_worker=1",
    "rollout.gpu_memory_utilization=0.5",
    "trainer.sync_backend=nccl",
]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(runtime_env={"env_vars": actor_env()})
    yield
    ray.shutdown()


@pytest.mark.parametrize("layout", ["colocated", "split"])
def test_grpo_steps_and_sync_on_gpu(local_ray, tmp_path: Path, layout: str) -> None:
    if layout == "split" and torch.cuda.device_count() < 2:
        pytest.skip("split mode needs 2 GPUs")
    overrides = COMMON + (COLOCATED if layout == "colocated" else SPLIT) + [f"trainer.run_dir={tmp_path}"]
    cfg = load(overrides=overrides)
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        trainer.run()
        worker = trainer.rollout.actors[0]
        prompt = JudgePrompt(
            item_id="t",
            system="Judge.",
            user="Rank the answers.",
            image=None,
            protocol="batch",
            style="ranking",
            num_candidates=3,
            shown=(0, 1, 2),
            target="ABC",
        )
        # The sampled tokens' log-probs (placeholders banned, as the learner bans them).
        sampled = ray.get(worker.generate.remote([prompt], 1, 0))[0]
        text = render_chat(trainer.processor, prompt, think_prefix=cfg.model.think_prefix)
        experience = Experience(prompt_text=text, image=None, response_ids=sampled.token_ids, advantage=0.0)
        learner = ray.get(trainer.learners[0].compute_logprobs.remote([experience], "policy"))[0]
        assert list(sampled.logprobs) == pytest.approx(list(learner), abs=5e-3)
        # The rollout engine and the learner agree per sampled token on each step's first update.
        metrics = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(m["rollout/logprob_diff_max"] < 5e-3 for m in metrics), metrics
    finally:
        trainer.shutdown()
