"""The GRPO driver: one process, the single controller of rollout, reward and learner actors.

The variant is verl's GRPO as used by the paper's training recipe:
- n = algo.group_size responses per prompt; advantage = (r - group mean) / (unbiased group std
  + 1e-6), broadcast to every response token; `algo.norm_adv_by_std=false` keeps only the mean
  subtraction (Dr.GRPO).
- Loss: the clipped ratio objective (clip 0.2/0.2) with dual clip c=3 for negative advantages,
  plus kl_coef * k3 ("low_var_kl") KL to a frozen reference model inside the loss, aggregated
  token-mean over the whole step's batch (independent of how it is split over ranks).
- On-policy by default: one optimizer step per training step, old logprobs = current ones.
  Every learner log-prob (current, old, reference) is of logits / rollout.temperature, the
  distribution the responses were sampled from, as in verl.
- A judge's reward = format x ranking, ranking = 1 - Levenshtein/K (the paper) or Kendall (the
  release). A policy is rewarded by a rule, a frozen judge on reward workers, or both; the task
  (`pjray.rl.task`) decides which, the loop is the same.
Unlike the paper's written objective (a per-sample mean 1/n sum_i, a generic KL term), and like
verl, which the paper trained with, it aggregates over tokens and uses the k3 estimator. What it
adds (dynamic sampling, counterfactual pairs, async rollouts): `Trainer`.

The trainer receives its inputs resolved (`pjray.types.TrainInputs`: the judge and the rows,
`pjray.recipes.training`) and asks its layout (`pjray.rl.layout`) everything that depends on
where the engines run: it never branches on the layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from ray.util.placement_group import PlacementGroup

from pjray.cluster import connect
from pjray.config import Config, ConfigError, to_dict
from pjray.console import DATA_REJECTS, HELD_OUT, HELD_OUT_ITEMS, PhaseClock, StallWatch, step_line
from pjray.data.sources import Rows
from pjray.memory import peak_memory_metrics, peak_memory_mib
from pjray.models.loading import load_processor
from pjray.placement import Placement, split_evenly
from pjray.rl.best import BEST_MODEL, BestJudge
from pjray.rl.checkpoint import checkpoint_to_resume, prune_checkpoints
from pjray.rl.collect import Collector, Rollouts, mean, rollout_metrics
from pjray.rl.grpo import group_advantages
from pjray.rl.items import item_sampler, prefilter
from pjray.rl.layout import Layout, choose_layout
from pjray.rl.learner import LearnerRank
from pjray.rl.task import Task, choose_task
from pjray.rl.timer import Timer
from pjray.signals import Interrupted, StopRequest
from pjray.staging import stage_on_nodes
from pjray.tracking import Tracker
from pjray.types import Experience, JudgeItem, JudgePrompt, TrainInputs

log = logging.getLogger(__name__)

# Pads a step's experiences to a whole number of micro-batches per rank: no response tokens, so
# no loss, no gradient and no share of the token counts.
FILLER = Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)

# generate(prompts, seed) -> one response text per prompt, from the rollout workers.
Generate = Callable[[list[JudgePrompt], int], list[str]]
# The held-out evaluation run every eval.every_steps steps (pjray.eval.runner.validation_hook):
# (config, generate, step) -> metrics. Handed in, so the driver never imports the evaluation.
EvalHook = Callable[[Config, Generate, int], dict[str, float]]
# (base judge, trained judge, the run's training items) -> the held-out check's numbers
# (pjray.eval.held_out.held_out_check, handed in by the CLI like the evaluation hook).
HeldOutHook = Callable[[str, str, Sequence[JudgeItem]], dict[str, Any]]
# (step, the step's metrics) -> None, after the tracker has them (a sweep reports them to Ray Tune).
StepHook = Callable[[int, dict[str, float]], None]


class Trainer:
    """One run. Groups whose rewards all equal carry no signal: their fraction is logged
    (`rollout/frac_zero_std`), `algo.filter_zero_std` drops and refills them (DAPO's dynamic
    sampling, a refill sized by the fraction kept so far), and `reward/*` stay the mean over every
    response generated (the policy, not the selection). `data.counterfactual_pairs` makes a group
    the same tuple on its image and its swapped image (half the responses each, one advantage
    group), so a verdict from the text alone cannot win both. Async rollouts
    (`trainer.max_staleness` = k >= 1, split layouts): steps t+1 .. t+k start generating before
    step t trains, so rollout workers sample while the learner trains. A worker runs its calls in
    the order sent (a sync waits for the generations sent before it, and later ones sample with
    its weights), so the batch of step t is sampled by the weights of step t-1-k (before step 1,
    the starting ones) and trained by those of step t-1, never more than k versions apart. Every
    completion carries the version that sampled it (`rollout/staleness_*`); `algo.rollout_is`
    corrects the gap."""

    def __init__(
        self,
        cfg: Config,
        inputs: TrainInputs,
        evaluate: EvalHook | None = None,
        held_out: HeldOutHook | None = None,
        placement_group: PlacementGroup | None = None,
        first_bundle: int = 0,
        on_step: StepHook | None = None,
    ):
        if cfg.eval.every_steps and evaluate is None:
            raise ConfigError("eval.every_steps: this trainer was given no evaluation hook (evaluate=)")
        self.cfg, self.inputs = cfg, inputs
        self.evaluate = evaluate
        self.held_out = held_out
        # The actors go into this group from `first_bundle` on (a Ray Tune trial's), else into
        # a group of the training's own (`pjray.placement.Placement`).
        self.placement_group, self.first_bundle = placement_group, first_bundle
        self.on_step = on_step
        self.layout: Layout = choose_layout(cfg)
        self.task: Task = choose_task(cfg)
        self.stalls = StallWatch(cfg.rollout.max_new_tokens)
        self.run_dir = Path(cfg.trainer.run_dir).resolve()
        # trainer.keep_best: the judge of the best validation so far (pjray.rl.best).
        self.best = (
            BestJudge(self.run_dir, cfg.trainer.keep_best, cfg.trainer.keep_best_mode)
            if cfg.trainer.keep_best
            else None
        )
        self.step = 0
        self.checkpointed_step = 0  # the step of the newest checkpoint, saved or resumed from
        # The training step whose update the learner's weights hold; the engines hold it after a
        # sync, and stamp it on what they sample (Completion.weight_version).
        self.weight_version = 0
        # SIGINT / SIGTERM: during set-up they stop at once; in the loop, after the step.
        self.stop = StopRequest()

    # ----------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        clock = PhaseClock(log)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A parquet or dataset is read (a stream opened) before Ray starts: a broken file costs
        # no cluster start-up.
        data = self.task.rows(self.inputs)
        clock.done("data")
        connect(cfg.ray)
        clock.done("ray")
        self.processor = load_processor(self.inputs.model, cfg.model.image_budget)
        clock.done("model")
        self.data = data = self.task.usable(data, self.processor, self.run_dir / DATA_REJECTS)
        self.start_actors(clock)
        resume_from = checkpoint_to_resume(self.cfg.trainer.resume, self.run_dir)
        saved: dict = {}
        if resume_from is not None:
            saved = self.resume(resume_from)
            clock.done("resume")
        train = prefilter(data, cfg, self.run_dir, resume_from is not None, self.processor, self.rollout, self.task)
        sampler = item_sampler(train, cfg, self.processor, saved, self.run_dir / DATA_REJECTS)
        self.collector = Collector(cfg, sampler, self.processor, self.rollout, self.task)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.tracker = Tracker(
            cfg.tracking, self.run_dir, to_dict(cfg), resume=resume_from is not None, start_step=self.step
        )

    def start_actors(self, clock: PhaseClock) -> None:
        """Place the roles and start them side by side (imports, weights, engines; the layout
        says when its engines may start), then connect the weight transport."""
        cfg = self.cfg
        self.placement = Placement(
            self.layout.roles() | self.task.roles(),
            strategy=cfg.ray.placement_strategy,
            timeout_s=cfg.ray.placement_timeout_s,
            group=self.placement_group,
            first=self.first_bundle,
        )
        clock.done("placement group")
        self.model = stage_on_nodes(self.inputs.model, cfg.model.stage_dir, self.placement.nodes())
        clock.done("checkpoint staged")
        self.learners = self.launch_learners()
        starting = [r.ready.remote() for r in self.learners]
        starting += self.task.start(self.placement, self.inputs)
        self.rollout = self.layout.start_rollout(
            self.placement, self.learners, starting, self.model, lambda: self.weight_version
        )
        ray.get(starting)
        clock.done("learners and workers")
        self.layout.connect(self.learners, self.rollout)
        clock.done("weight sync")

    def launch_learners(self) -> list:
        """The learner rank actors, started (their constructors run on; `ready` waits)."""
        cfg = self.cfg
        addr, port = self.placement.master_address("learner")
        port = cfg.learner.master_port or port
        sequences = cfg.trainer.prompts_per_step * cfg.algo.group_size
        per_rank = sequences // (cfg.algo.ppo_mini_batches * cfg.learner.num_ranks)
        total_updates = cfg.trainer.steps * cfg.algo.ppo_mini_batches * cfg.algo.ppo_epochs
        threads = self.placement.threads("learner", cfg.learner.num_threads)
        return [
            self.placement.launch(
                "learner",
                LearnerRank,
                r,
                cfg.model,
                cfg.learner,
                cfg.algo,
                self.model,
                rank=r,
                world_size=cfg.learner.num_ranks,
                master_addr=addr,
                master_port=port,
                total_steps=total_updates,
                grad_accum_steps=max(1, per_rank // cfg.learner.micro_batch_size),
                norm_len=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                top_k=cfg.rollout.top_k,
                top_p=cfg.rollout.top_p,
                num_threads=threads[r],
                rollout_cfg=self.layout.learner_rollout(),
            )
            for r in range(cfg.learner.num_ranks)
        ]

    def resume(self, checkpoint: Path) -> dict:
        """Load a checkpoint into the learner ranks and the engines; returns the sampler's state."""
        trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
        ray.get([r.load_checkpoint.remote(str(checkpoint / "learner")) for r in self.learners])
        self.step = self.checkpointed_step = self.weight_version = trainer_state["step"]
        self.sync_weights()
        log.info("resumed from %s at step %d", checkpoint, self.step)
        return trainer_state["sampler"]

    # ----------------------------------------------------------------------------- the loop
    def run(self) -> None:
        cfg = self.cfg.trainer
        with self.stop.deferred():
            self.loop()
        if self.stop.requested and self.step < cfg.steps:
            # Everything logged so far is in a checkpoint: an interrupt costs at most the step
            # it arrived in (finished here, so none).
            if self.checkpointed_step != self.step:
                self.save_checkpoint()
            signame = signal.Signals(self.stop.signum).name
            raise Interrupted(
                self.stop.signum,
                f"stopped by {signame} at step {self.step}/{cfg.steps}: checkpoint "
                f"{self.run_dir / 'checkpoints' / f'global_step_{self.step}'}; to continue, run the "
                "same command with trainer.resume=auto",
            )
        if cfg.export_hf:
            self.export_hf()
            if self.held_out is not None and self.inputs.base_judge:
                self.held_out_check()

    def held_out_check(self) -> None:
        """The run's judge against the base judge it started from on scenes held out by content
        from both judges' training items (`self.held_out`), written to held_out.json, with one
        row per judge and item in held_out_items.parquet; `pjray train` prints it at the end. The
        same prompts for both, so the difference is what the run learned, free of its reward
        curve's noise."""
        assert self.held_out is not None
        items = self.data.rows if isinstance(self.data, Rows) else []
        started = time.perf_counter()
        result = self.held_out(self.inputs.model, str(self.run_dir / "hf_model"), items)
        verdicts = result.pop("verdicts")
        pq.write_table(pa.Table.from_pylist(verdicts), self.run_dir / HELD_OUT_ITEMS)
        (self.run_dir / HELD_OUT).write_text(json.dumps(result, indent=2))
        log.info(
            "held-out check: %.1fs, written to %s (per item: %s)",
            time.perf_counter() - started,
            self.run_dir / HELD_OUT,
            HELD_OUT_ITEMS,
        )

    def loop(self) -> None:
        cfg = self.cfg.trainer
        started, first_step = time.perf_counter(), self.step
        while self.step < cfg.steps and not self.stop.requested:
            self.step += 1
            metrics = self.train_step()
            if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                # Held-out metrics (eval/*), judged by the rollout pool (the hook is checked in __init__).
                metrics.update(self.evaluate(self.cfg, self.collector.judge_texts, self.step))
                if self.best is not None and self.best.improves(metrics):
                    self.best.record(self.step, metrics, self.export_hf(self.run_dir / BEST_MODEL))
            self.tracker.log(metrics, self.step)
            if self.on_step is not None:
                self.on_step(self.step, metrics)
            seconds_per_step = (time.perf_counter() - started) / (self.step - first_step)
            log.info(step_line(self.step, cfg.steps, metrics, seconds_per_step))
            for line in self.stalls.update(metrics):
                log.warning(line)
            if self.step in cfg.export_steps:
                self.export_hf(self.run_dir / f"hf_model_step_{self.step}")
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                self.save_checkpoint()

    def train_step(self) -> dict[str, float]:
        timer = Timer()
        start = time.perf_counter()

        # Generate and score; with filtering, drop zero-variance groups and refill (gen, reward).
        rollouts = self.collector.collect(self.step, timer)
        stale = self.layout.staleness(self.weight_version, rollouts.completions)
        if max(stale, default=0) > self.cfg.trainer.max_staleness:
            raise RuntimeError(
                f"step {self.step}: a sample {max(stale)} weight versions old, over "
                f"trainer.max_staleness={self.cfg.trainer.max_staleness}"
            )
        self.layout.after_generation(self.rollout, timer)

        # Group-relative advantages over the kept groups.
        with timer("adv"):
            rewards = torch.tensor([r.total for r in rollouts.rewards], dtype=torch.float32)
            advantages = group_advantages(
                rewards,
                self.cfg.algo.group_size,
                norm_by_std=self.cfg.algo.norm_adv_by_std,
                eps=self.cfg.algo.adv_eps,
            )
            experiences = self.experiences(rollouts, advantages.tolist())

        # Reference logprobs for the KL term.
        if self.cfg.algo.kl_coef > 0:
            with timer("ref"):
                experiences = self.attach_logprobs(experiences, "ref", timer)

        # Old-policy logprobs, needed only when a step takes several optimizer steps.
        if self.cfg.algo.ppo_mini_batches * self.cfg.algo.ppo_epochs > 1:
            with timer("old_log_prob"):
                experiences = self.attach_logprobs(experiences, "policy", timer)

        # The policy update: mini-batches x epochs optimizer steps over DeepSpeed ranks.
        with timer("update"):
            actor_metrics = self.update(experiences, timer)
        self.weight_version = self.step

        # Send the new weights to every rollout engine, once the generations ahead are done.
        with timer("wait_generation"):
            self.collector.wait_for_generation()
        with timer("sync"):
            self.sync_weights()

        timer.seconds["step"] = time.perf_counter() - start
        metrics = self.step_metrics(rollouts, advantages, actor_metrics, timer)
        metrics["rollout/staleness_mean"] = mean([float(v) for v in stale])
        metrics["rollout/staleness_max"] = float(max(stale, default=0))
        return {**metrics, **self.memory_metrics()}

    def memory_metrics(self) -> dict[str, float]:
        """Peak host (and GPU) memory so far of each role's largest actor, and of the driver."""
        roles = self.layout.memory_roles(self.learners, self.task.pools, self.rollout)
        answers = iter(ray.get([a.peak_memory.remote() for actors in roles.values() for a in actors]))
        peaks = {
            "driver": [peak_memory_mib()],
            **{role: [next(answers) for _ in actors] for role, actors in roles.items()},
        }
        return peak_memory_metrics(peaks)

    # ----------------------------------------------------------------------------- phases
    def experiences(self, rollouts: Rollouts, advantages: list[float]) -> list[Experience]:
        n = self.collector.responses_per_prompt
        return [
            Experience(
                prompt_text=rollouts.texts[i // n],
                image=rollouts.prompts[i // n].image,
                response_ids=c.token_ids,
                advantage=advantages[i],
                rollout_logprobs=c.logprobs,
            )
            for i, c in enumerate(rollouts.completions)
        ]

    def padded_shards(self, experiences: list[Experience]) -> list[list[list[Experience]]]:
        """[mini-batch][rank] -> shard. Every shard has the same length (ZeRO collectives need
        every rank to run the same forwards); the padding rows have empty responses, so they
        carry no tokens, no loss and no gradient."""
        cfg = self.cfg
        per_mini = cfg.trainer.prompts_per_step * cfg.algo.group_size // cfg.algo.ppo_mini_batches
        padded = experiences + [FILLER] * (per_mini * cfg.algo.ppo_mini_batches - len(experiences))
        minis = [padded[m * per_mini : (m + 1) * per_mini] for m in range(cfg.algo.ppo_mini_batches)]
        return [split_evenly(mini, cfg.learner.num_ranks) for mini in minis]

    def attach_logprobs(self, experiences: list[Experience], which: str, timer: Timer) -> list[Experience]:
        field, phase = ("ref_logprobs", "ref") if which == "ref" else ("old_logprobs", "old_log_prob")
        out: list[Experience] = []
        for mini in self.padded_shards(experiences):
            calls = [r.compute_logprobs_timed.remote(shard, which) for r, shard in zip(self.learners, mini)]
            per_rank = timer.unwrap(phase, ray.get(calls))
            for shard, logprobs in zip(mini, per_rank):
                out.extend(dataclasses.replace(e, **{field: lp}) for e, lp in zip(shard, logprobs))
        return out[: len(experiences)]

    def update(self, experiences: list[Experience], timer: Timer) -> dict[str, float]:
        collected: dict[str, list[float]] = defaultdict(list)
        for epoch in range(self.cfg.algo.ppo_epochs):
            for mini in self.padded_shards(experiences):
                real = [e for shard in mini for e in shard if e.response_ids]
                tokens = float(sum(len(e.response_ids) for e in real))
                if not real:
                    continue
                calls = [
                    r.train_step_timed.remote(shard, tokens, float(len(real))) for r, shard in zip(self.learners, mini)
                ]
                per_rank = timer.unwrap("update", ray.get(calls))
                for metrics in per_rank:
                    for key, value in metrics.items():
                        collected[key].append(value)
        return {key: mean(values) for key, values in collected.items()}

    def sync_weights(self) -> None:
        """The learner's weights to every rollout engine, as the layout does it."""
        self.layout.sync(self.learners, self.rollout, self.weight_version)

    # ----------------------------------------------------------------------------- outputs
    def step_metrics(
        self, rollouts: Rollouts, advantages: torch.Tensor, actor: dict[str, float], timer: Timer
    ) -> dict[str, float]:
        tokens = sum(len(c.token_ids) for c in rollouts.completions)
        return {
            **rollout_metrics(rollouts, advantages, self.cfg.algo.group_size),
            "rollout/worker_restarts": float(self.rollout.restarts + sum(p.restarts for p in self.task.pools.values())),
            "data/consumed": float(self.collector.trained_state().consumed),
            "data/rejected": float(self.rejected_rows()),
            "data/epoch": float(self.collector.sampler.epoch),
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / timer.seconds["step"],
            "training/global_step": float(self.step),
            **actor,
            **timer.metrics(),
            **self.task.metrics(timer.seconds),
        }

    def rejected_rows(self) -> int:
        """Training rows skipped as unusable: all of them, or those a stream has read so far."""
        return len(self.data.rejects) if isinstance(self.data, Rows) else self.collector.sampler.state.rejected

    def save_checkpoint(self) -> None:
        cfg = self.cfg.trainer
        path = self.run_dir / "checkpoints" / f"global_step_{self.step}"
        ray.get([r.save_checkpoint.remote(str(path / "learner"), {"step": self.step}) for r in self.learners])
        state = {"step": self.step, "sampler": dataclasses.asdict(self.collector.trained_state()), "seed": cfg.seed}
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / "COMPLETE").touch()  # written last: a checkpoint without it is ignored by resume
        self.checkpointed_step = self.step
        prune_checkpoints(self.run_dir, cfg.keep_checkpoints)

    def export_hf(self, path: Path | None = None) -> Path:
        """The judge as an HF directory (default: <run_dir>/hf_model)."""
        path = path or self.run_dir / "hf_model"
        ray.get([r.save_hf.remote(str(path)) for r in self.learners])
        return path

    def shutdown(self) -> None:
        if hasattr(self, "tracker"):
            self.tracker.close()
        if hasattr(self, "placement"):
            if hasattr(self, "learners"):
                self.layout.close(self.learners)
            self.placement.shutdown()  # every learner, rollout and reward actor


def train(
    cfg: Config,
    inputs: TrainInputs,
    evaluate: EvalHook | None = None,
    held_out: HeldOutHook | None = None,
    placement_group: PlacementGroup | None = None,
    first_bundle: int = 0,
    on_step: StepHook | None = None,
) -> Path:
    """Run a whole training job from `inputs` (with `evaluate` every eval.every_steps, `held_out` at
    the end of a run from a base judge, `on_step` after every step, its actors in `placement_group`
    from `first_bundle` on if one is given); returns the run directory."""
    trainer = Trainer(cfg, inputs, evaluate, held_out, placement_group, first_bundle, on_step)
    with trainer.stop:
        try:
            trainer.setup()
            trainer.run()
        finally:
            trainer.shutdown()
    return trainer.run_dir
