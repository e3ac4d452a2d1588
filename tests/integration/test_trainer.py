"""The GRPO driver end to end on CPU: real Ray, real DeepSpeed (gloo), a tiny random judge."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import ray
import torch

from pjray.cli import main
from pjray.config import load
from pjray.console import run_summary
from pjray.models.tiny_families import FAMILY_ARCHS
from pjray.recipes.training import training_inputs
from pjray.rl.checkpoint import latest_checkpoint
from pjray.rl.timer import Timer
from pjray.rl.trainer import Trainer
from pjray.sync.transports import make_transport
from pjray.types import Completion, Timed
from tests.support.preference import write_vlrb

pytestmark = pytest.mark.slow

TINY = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "data.num_items=32",
    "data.image_size=64",
    "rollout.max_new_tokens=12",
    "trainer.prompts_per_step=4",
    "algo.group_size=4",
    "learner.micro_batch_size=4",
    "tracking.wandb=false",
]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_ray_overhead(metrics: dict, phases: tuple[str, ...]) -> None:
    """Worker compute of each phase lies within the phase's wall time, its overhead is the rest,
    and the step's Ray overhead is the step's wall time less all the compute."""
    compute, overheads = 0.0, 0.0
    for phase in phases:
        wall = metrics[f"timing_s/{phase}"]
        busy = metrics[f"timing_s/{phase}_compute"]
        overhead = metrics[f"timing_s/{phase}_overhead"]
        assert 0 < busy <= wall + 1e-3, (phase, busy, wall)
        assert overhead == pytest.approx(wall - busy, abs=1e-9)
        compute += busy
        overheads += overhead
    assert metrics["timing_s/compute"] == pytest.approx(compute, abs=1e-9)
    assert metrics["timing_s/ray_overhead"] == pytest.approx(metrics["timing_s/step"] - compute, abs=1e-9)
    # The step's overhead also holds the phases without worker compute (sync) and driver work.
    assert metrics["timing_s/ray_overhead"] >= overheads + metrics["timing_s/sync"] - 1e-3


def test_timer_counts_the_slowest_worker_per_call():
    timer = Timer()
    # Two calls of the update phase: the driver waits for the slower rank of each.
    assert timer.unwrap("update", [Timed("a", 0.2), Timed("b", 0.3)]) == ["a", "b"]
    timer.unwrap("update", [Timed("c", 0.1)])
    timer.seconds.update(update=0.5, sync=0.1, step=0.7)
    metrics = timer.metrics()
    assert metrics["timing_s/update_compute"] == pytest.approx(0.4)
    assert metrics["timing_s/update_overhead"] == pytest.approx(0.1)
    assert "timing_s/sync_compute" not in metrics and "timing_s/gen_compute" not in metrics
    assert metrics["timing_s/compute"] == pytest.approx(0.4)
    assert metrics["timing_s/ray_overhead"] == pytest.approx(0.3)


def _learn_trivial_reward(run_dir: Path, overrides: list[str], target: float) -> tuple[dict, float, int]:
    """Train the tiny judge on the reward 1 when the response opens with a space, up to 40 steps
    or until the mean reward reaches `target`: (step 1's metrics, the best mean reward, steps)."""
    cfg = load(
        overrides=TINY
        + [
            f"trainer.run_dir={run_dir}",
            "reward.function=learnable_rewards:starts_with_space",
            "learner.lr=1e-2",
            "algo.kl_coef=0.0",
            "algo.group_size=8",
            "rollout.max_new_tokens=4",
            "trainer.steps=40",
            "trainer.save_every=0",
            "trainer.export_hf=false",
            *overrides,
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        first = trainer.train_step()
        trainer.step = 1
        best = first["reward/mean"]
        for trainer.step in range(2, cfg.trainer.steps + 1):
            best = max(best, trainer.train_step()["reward/mean"])
            if best >= target:
                break
    finally:
        trainer.shutdown()
    return first, best, trainer.step


def test_learns_a_trivial_reward_with_two_ranks(ray_local, tmp_path):
    """Sign and plumbing of the whole loop: reward 1 when the response opens with a space
    (chance ~0.2 for the random judge); the mean reward rises to >= 0.9."""
    first, best, steps = _learn_trivial_reward(
        tmp_path / "learn", ["learner.num_ranks=2", "learner.micro_batch_size=2"], target=0.9
    )
    assert first["reward/mean"] < 0.5
    assert best >= 0.9, f"mean reward only reached {best:.2f} in {steps} steps"
    # Every role's peak memory is logged: the learner ranks (which generate here) hold a model,
    # the reward worker does not, and nothing runs on a GPU.
    peaks = {k: v for k, v in first.items() if k.startswith("memory/")}
    assert sorted(peaks) == ["memory/driver_peak_mib", "memory/learner_peak_mib", "memory/reward_peak_mib"]
    assert peaks["memory/learner_peak_mib"] > peaks["memory/reward_peak_mib"] > 50


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_judge_of_each_family_learns_the_trivial_reward(ray_local, tmp_path, arch: str):
    """`pjray train` with a tiny LLaVA-OneVision, InternVL, Gemma 3 or Idefics3 judge on images
    (hybrid engine, packed micro-batches, the vision part trained): the trivial reward rises from
    chance (~0.2) to >= 0.8."""
    first, best, steps = _learn_trivial_reward(
        tmp_path / arch,
        [
            f"model.tiny_arch={arch}",
            "model.freeze_vision=false",
            "learner.packing=true",
            "learner.micro_batch_tokens=2048",
            "learner.micro_batch_size=8",
        ],
        target=0.8,
    )
    assert first["reward/mean"] < 0.5 and best >= 0.8, (
        f"{arch}: mean reward {first['reward/mean']:.2f} -> at best {best:.2f} in {steps} steps"
    )


def test_lora_learns_the_trivial_reward_and_exports_merged_weights(ray_local, tmp_path):
    """The same reward with LoRA adapters (hybrid engine, KL against the adapters-off base):
    the reward rises, and the export differs from the base judge only in adapted layers. The
    random judge's logits are near uniform because its output projection is tiny, so adapters
    on the hidden layers alone barely move them: the output projection gets one here."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "lora"
    cfg = load(
        overrides=TINY
        + [
            f"trainer.run_dir={run_dir}",
            "reward.function=learnable_rewards:starts_with_space",
            "model.lora.rank=8",
            "model.lora.alpha=16",
            "model.lora.target_modules=[q_proj,v_proj,lm_head]",
            "learner.lr=5e-2",
            "algo.kl_coef=0.001",
            "algo.group_size=8",
            "learner.micro_batch_size=8",
            "rollout.max_new_tokens=4",
            "trainer.steps=25",
            "trainer.save_every=0",
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))
    rewards = []
    try:
        trainer.setup()
        for trainer.step in range(1, cfg.trainer.steps + 1):
            rewards.append(trainer.train_step()["reward/mean"])
            if rewards[-1] >= 0.9:
                break
        export = trainer.export_hf()
    finally:
        trainer.shutdown()
    assert rewards[0] < 0.5 and max(rewards) >= 0.9, rewards
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    base = load_file(run_dir / "base_model" / "model.safetensors")
    merged = load_file(export / "model.safetensors")
    assert merged.keys() == base.keys()
    changed = sorted(k for k in base if not torch.equal(base[k], merged[k]))
    assert "lm_head.weight" in changed
    assert all(
        k == "lm_head.weight" or (k.endswith(("q_proj.weight", "v_proj.weight")) and "visual" not in k) for k in changed
    ), changed


def test_train_checkpoint_export_and_resume(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    common = TINY + [
        f"trainer.run_dir={run_dir}",
        "learner.num_ranks=2",
        "learner.micro_batch_size=2",
        "learner.zero_stage=2",
        "rollout.num_workers=1",
        "reward.num_workers=1",
        "trainer.save_every=3",
        # Each group: the tuple on its image and on its swapped image, two responses each.
        "data.counterfactual_pairs=true",
    ]
    # Validation on VL-RewardBench rows (real and mismatched images) runs on step 3 only, and
    # keeps the best judge by its gap; the judge of step 2 is exported too.
    bench = write_vlrb(tmp_path / "vlrb")
    validation = [
        "eval.every_steps=3",
        "eval.train_bench=vl_rewardbench",
        f"eval.data={bench}",
        "eval.train_num_items=4",
        "eval.blind=[mismatched]",
        "eval.prompt_format=paper",
        "trainer.keep_best=eval/vl_rewardbench/gap",
    ]
    assert main(["train", *common, *validation, "trainer.steps=3", "trainer.export_steps=[2]"]) == 0
    first = read_metrics(run_dir)
    assert [m["step"] for m in first] == [1, 2, 3]
    assert all(m["rollout/groups_kept"] == 4 for m in first)  # trainer.prompts_per_step groups of algo.group_size
    assert (run_dir / "hf_model_step_2" / "model.safetensors").exists() and not (run_dir / "hf_model_step_1").exists()
    assert "eval/vl_rewardbench/accuracy" not in first[1]
    assert {
        "eval/vl_rewardbench/accuracy",
        "eval/vl_rewardbench/accuracy_mismatched",
        "eval/vl_rewardbench/gap",
    } <= set(first[2])
    best = json.loads((run_dir / "best.json").read_text())
    assert best["step"] == 3 and best["value"] == first[2]["eval/vl_rewardbench/gap"]
    assert (run_dir / "hf_model_best" / "model.safetensors").exists()
    assert any("best validation: eval/vl_rewardbench/gap" in line for line in run_summary(run_dir, 1.0))
    for key in (
        "reward/mean",
        "reward/std",
        "rollout/frac_zero_std",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/ref",
        "timing_s/update",
        "timing_s/sync",
        "perf/throughput",
        "response_length/mean",
        "response_length/clip_ratio",
        "rollout/logprob_diff_mean",
        "rollout/logprob_diff_max",
    ):
        assert key in first[-1], key
    for metrics in first:  # two learner ranks: compute is the slower rank's
        check_ray_overhead(metrics, ("gen", "reward", "ref", "update"))
        # The HF engine and the DeepSpeed learner agree on every sampled token (fp32, same weights
        # after each sync); a different processor or dtype between them would show here.
        assert 0 <= metrics["rollout/logprob_diff_mean"] <= metrics["rollout/logprob_diff_max"] < 1e-3
        # The random judge rarely writes EOS within 12 tokens: most responses are cut.
        assert 0.5 < metrics["response_length/clip_ratio"] <= 1.0
    assert latest_checkpoint(run_dir).name == "global_step_3"
    hf = run_dir / "hf_model"
    assert (hf / "config.json").exists()

    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(hf) is not None

    # Resume: continue at step 4 from the saved data position.
    assert main(["train", *common, *validation, "trainer.steps=5", "trainer.resume=auto"]) == 0
    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    per_step = 4  # trainer.prompts_per_step
    assert resumed[3]["data/consumed"] == first[2]["data/consumed"] + per_step


def test_missing_data_path_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="no such file"):
        cfg = load(
            overrides=TINY
            + [f"trainer.run_dir={tmp_path}", "data.source=parquet", f"data.path={tmp_path}/none.parquet"]
        )
        Trainer(cfg, training_inputs(cfg)).setup()


def thinking_judge(path: Path) -> Path:
    """A tiny judge whose chat template opens <think> in the generation prompt itself, as
    thinking checkpoints do."""
    from pjray.models.loading import load_processor
    from pjray.models.tiny import build_tiny_judge

    build_tiny_judge(path, seed=0)
    processor = load_processor(path)
    template = processor.chat_template.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert template != processor.chat_template
    processor.chat_template = processor.tokenizer.chat_template = template
    processor.save_pretrained(path)
    return path


def test_sync_is_exact_and_dead_workers_are_replaced(ray_local, tmp_path):
    """The object store (the transport every layout has), then shared memory (what `auto` picks
    for HF engines on the learner's node): after each sync, and after dead workers are rebuilt
    (a rollout worker brought to the current weights through each, whether it died between
    steps or before a sync reached it), every engine holds the learner's weights and their
    version."""
    # A thinking template with model.think_prefix=false: the prompts still open <think>.
    cfg = load(
        overrides=TINY
        + [
            f"model.path={thinking_judge(tmp_path / 'judge')}",
            "model.think_prefix=false",
            f"trainer.run_dir={tmp_path / 'ft'}",
            "rollout.backend=hf",
            "rollout.num_workers=2",
            "reward.num_workers=1",
            "trainer.steps=3",
            "learner.lr=1e-2",
            "trainer.sync_bucket_mb=1",
            "trainer.sync_backend=auto",
            # The study's arms ride along: every group also sampled on another prompt's image
            # (scored, not trained), and each prompt's target shuffled.
            "algo.contrast_responses=2",
            "reward.shuffle_target=true",
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))

    def engines_hold_the_learners_weights() -> None:
        learner_sums = ray.get(trainer.learners[0].checksums.remote())
        for worker in trainer.rollout.actors:
            assert ray.get(worker.checksums.remote()) == learner_sums
            assert ray.get(worker.__ray_call__.remote(lambda w: w.weight_version)) == trainer.weight_version

    try:
        trainer.setup()
        # auto: HF engines on the learner's node sync through shared memory (set up here).
        assert trainer.layout.transport.name == "shm"
        shared = trainer.layout.transport
        trainer.layout.transport = make_transport("object_store", shared.bucket_bytes)  # for steps 1 and 2
        trainer.step = 1
        trainer.train_step()
        engines_hold_the_learners_weights()
        ray.kill(trainer.rollout.actors[1], no_restart=True)
        trainer.step = 2
        assert trainer.train_step()["rollout/worker_restarts"] == 1
        engines_hold_the_learners_weights()
        # Both workers dead when the sync reaches them: both rebuilt before either is brought to
        # the weights, and the sync completes.
        for worker in trainer.rollout.actors:
            ray.kill(worker, no_restart=True)
        trainer.sync_weights()
        assert trainer.rollout.restarts == 3
        engines_hold_the_learners_weights()

        # Shared memory. Kill one rollout worker and the reward worker between steps: the next
        # step rebuilds them, gives the new rollout worker the current weights and completes,
        # counting each prompt once.
        trainer.layout.transport = shared
        consumed = trainer.collector.sampler.state.consumed
        ray.kill(trainer.rollout.actors[0], no_restart=True)
        ray.kill(trainer.task.pools["reward"].actors[0], no_restart=True)
        trainer.step = 3
        metrics = trainer.train_step()
        assert metrics["rollout/worker_restarts"] == 5  # the run's restarts so far
        assert metrics["rollout/groups_kept"] == cfg.trainer.prompts_per_step
        assert 0.0 <= metrics["reward/contrast_bonus_mean"] <= cfg.algo.image_contrast
        assert trainer.collector.sampler.state.consumed == consumed + cfg.trainer.prompts_per_step
        engines_hold_the_learners_weights()
        ray.kill(trainer.rollout.actors[1], no_restart=True)
        trainer.sync_weights()
        assert trainer.rollout.restarts == 5
        engines_hold_the_learners_weights()

        # The reward reads the think prefill from each prompt's text, not model.think_prefix:
        # the template opened <think>, so a response must close it without opening it again.
        r, _, _ = trainer.collector.generate(1, seed=99, timer=Timer())
        prompts, texts = r.prompts, r.texts
        assert texts[0].endswith("<think>\n")
        good = "the cars are red\n</think>\n<answer>" + prompts[0].target + "</answer>"
        completions = [
            Completion(0, i, (1, 2, 3), (-1.0, -1.0, -1.0), text, "stop")
            for i, text in enumerate([good, "<think>" + good, good + " and more", good])
        ]
        completions[3] = dataclasses.replace(completions[3], finish_reason="length")
        results = trainer.collector.score(prompts, texts, completions, Timer())
        assert [r.total for r in results] == [1.0, 0.0, 0.0, 0.0], [r.reason for r in results]
        buffers = ray.get(trainer.learners[0].export_shared.remote(1 << 20))[1]
    finally:
        trainer.shutdown()
    assert buffers
    assert not [p for p in buffers if Path(p).exists()]  # the trainer removed its shared buffers


def test_a_sync_group_member_that_never_joins_is_named_and_nothing_waits_for_it(ray_local):
    """The broadcast transport forms the real gloo group of a (fake) learner rank 0 and two
    one-rank engines. With both engines joining it forms; with one busy elsewhere, `connect`
    fails within the group's join bound, naming that engine (as rank 0 saw it), not after the
    backend's 600 s or never."""
    from recording_actors import GroupLearnerRank, GroupRolloutWorker

    class Pool:  # the two attributes of a WorkerPool the transport reads
        def __init__(self, actors):
            self.actors = actors

        def __len__(self):
            return len(self.actors)

    actors = []
    try:
        for absent in (False, True):
            learner = ray.remote(num_cpus=0)(GroupLearnerRank).remote()
            workers = [ray.remote(num_cpus=0)(GroupRolloutWorker).remote(a) for a in (False, absent)]
            actors += [learner, *workers]
            transport = make_transport("gloo", 1 << 20)
            transport.join_s = 3.0
            start = time.monotonic()
            if not absent:
                transport.connect([learner], Pool(workers))
                assert transport.plan == []
                continue
            with pytest.raises(ray.exceptions.RayTaskError) as failed:
                transport.connect([learner], Pool(workers))
            assert time.monotonic() - start < 30
            assert re.search(r"rank 0 of 3.*: never joined within 3s: rollout worker 1 \(rank 2\)", str(failed.value))
    finally:
        for actor in actors:
            ray.kill(actor)


def test_colocated_sync_hands_gpu_memory_over_in_order(ray_local, tmp_path):
    """The driver's side of the colocated IPC sync, with recording fakes of the learner ranks and
    the sleeping vLLM workers (no GPU here; the engine's side is tests/unit/test_colocated_sync.py):
    the learners return their cached blocks, each streams its buckets to its engine (the real
    `stream_buckets`, called from the learner actor on the worker actor), the engines learn the
    weights' version, and only then do the engines wake their KV caches. A worker that dies
    during its stream is rebuilt and brought up to date through the object store."""
    from recording_actors import CallLog, RecordingLearnerRank, RecordingRolloutWorker

    from pjray.placement import Placement, RoleResources, WorkerPool

    cfg = load(
        overrides=TINY
        + [
            f"trainer.run_dir={tmp_path}",
            "rollout.backend=vllm",
            "rollout.colocate=true",
            "trainer.sync_backend=ipc",
            "learner.num_ranks=2",
            "rollout.num_workers=2",
            "learner.micro_batch_size=2",
            "learner.num_gpus_per_rank=0.5",
            "rollout.num_gpus_per_worker=0.4",
        ]
    )
    log = ray.remote(num_cpus=0)(CallLog).remote()
    trainer = Trainer(cfg, training_inputs(cfg))
    trainer.learners = [ray.remote(num_cpus=0)(RecordingLearnerRank).remote(log, r) for r in range(2)]
    placement = Placement({"rollout": RoleResources(2, 0.1, 0.0)}, strategy="PACK")

    def refresh(worker):  # what the colocated layout's own pool does for a rebuilt worker
        trainer.layout.refresh(trainer.learners, trainer.rollout, worker, trainer.weight_version)

    trainer.rollout = WorkerPool(
        placement, "rollout", RecordingRolloutWorker, lambda i: (log, i), max_retries=0, on_restart=refresh
    )
    try:
        trainer.layout.connect(
            trainer.learners, trainer.rollout
        )  # trainer.sync_backend=ipc: the CUDA IPC transport, nothing to connect
        trainer.sync_weights()
        calls = ray.get(log.calls.remote())
        ray.get(log.doom.remote(1))
        trainer.sync_weights()
        after_death = ray.get(log.calls.remote())[len(calls) :]
    finally:
        trainer.rollout.shutdown()
        placement.shutdown()
        for actor in trainer.learners:
            ray.kill(actor)
    streamed = ["stream_ipc", "begin_ipc"] + ["load_ipc_bucket"] * 3 + ["finish_ipc"]
    for i in (0, 1):  # learner rank i and worker i
        assert [m for m, j in calls if j == i] == ["release_memory", *streamed, "set_weight_version", "wake_up"], calls
    methods = [m for m, _ in calls]
    assert methods.index("stream_ipc") > max(k for k, m in enumerate(methods) if m == "release_memory")
    assert methods.index("set_weight_version") > max(k for k, m in enumerate(methods) if m == "finish_ipc")
    # Worker 1 dies at its first bucket; the rebuilt one takes the weights from the object store.
    assert [m for m, j in after_death if j == 1] == [
        "release_memory",
        "stream_ipc",
        "begin_ipc",
        "export_weights",
        "load_weights",
        "set_weight_version",
        "set_weight_version",
        "wake_up",
    ], after_death
    assert trainer.rollout.restarts == 1
