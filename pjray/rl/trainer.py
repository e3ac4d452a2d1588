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
- Reward = format x ranking, ranking = 1 - Levenshtein/K (the paper) or Kendall (the release).

Where it differs from the paper's written objective: the paper writes a per-sample mean
(1/n sum_i) and a generic KL term; like verl (which the paper trained with) we aggregate over
tokens and use the k3 estimator. Groups whose rewards all equal carry no signal; their fraction is
logged (`rollout/frac_zero_std`) and `algo.filter_zero_std` drops and refills them (DAPO's
dynamic sampling), a refill sized by the fraction kept so far; `reward/*` stay the mean over every
response generated, so they measure the policy, not the selection. Beyond the paper,
`data.counterfactual_pairs` makes each group the same tuple on its image and on its swapped image
(half the responses each, one advantage group), so a verdict from the text alone cannot win both.

Async rollouts (`trainer.max_staleness` = k >= 1, split layouts): the driver starts the generation
of steps t+1 .. t+k before training step t, so the rollout workers sample while the learner
trains. A worker runs its calls in the order the driver sent them, so a sync waits for the
generations started before it and a generation started after it samples with its weights: the
batch of step t is sampled by the weights of step t-1-k (before step 1, the starting ones) and
trained by those of step t-1, never more than k versions apart. Every completion carries the
version that sampled it (`rollout/staleness_*`), and `algo.rollout_is` corrects the gap.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shutil
import signal
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from ray.util.placement_group import PlacementGroup

from pjray.cluster import connect
from pjray.config import Config, ConfigError, to_dict
from pjray.console import DATA_REJECTS, HELD_OUT, HELD_OUT_ITEMS, PhaseClock, StallWatch, step_line
from pjray.data.hf import DatasetItems, StreamSampler, StreamState, open_dataset, train_ref
from pjray.data.prompts import render_batch
from pjray.data.sampler import ItemSampler, SamplerState, shown_order
from pjray.data.sources import RowReject, Rows, scan_items, write_rejects
from pjray.memory import peak_memory_mib
from pjray.models.loading import load_processor, opens_think, processor_inputs, render_chat
from pjray.placement import Placement, RankGroup, RoleResources, WorkerPool, split_evenly
from pjray.ppjd.swap import counterfactual_pair
from pjray.reward.workers import RewardWorker
from pjray.rl.best import BEST_MODEL, BestJudge
from pjray.rl.grpo import group_advantages, zero_std_groups
from pjray.rl.learner import LearnerRank
from pjray.rollout.worker import PendingGeneration, RolloutWorker, generate_with_pool, submit_generation
from pjray.signals import Interrupted, StopRequest
from pjray.sync.transports import auto_transport, make_transport
from pjray.tracking import Tracker
from pjray.types import Completion, Experience, JudgeItem, JudgePrompt, RewardResult, Timed

log = logging.getLogger(__name__)

# Pads a step's experiences to a whole number of micro-batches per rank: no response tokens, so
# no loss, no gradient and no share of the token counts.
FILLER = Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)

# Phases whose work runs in workers that time it themselves (Timed answers).
COMPUTE_PHASES = ("gen", "reward", "ref", "old_log_prob", "update")

T = TypeVar("T")

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


def training_roles(cfg: Config) -> dict[str, RoleResources]:
    """The actors a training places, by role: learner ranks, rollout workers (none with the
    hybrid engine: the learner ranks generate) and reward workers."""
    roles = {
        "learner": RoleResources(
            cfg.learner.num_ranks, cfg.learner.num_cpus_per_rank, cfg.learner.num_gpus_per_rank,
            resources=dict(cfg.learner.resources),
        ),
        # Colocated: rollout worker i runs in learner rank i's GPU bundle.
        "rollout": RoleResources(
            cfg.rollout.num_workers, cfg.rollout.num_cpus_per_worker, cfg.rollout.num_gpus_per_worker,
            share_with="learner" if cfg.rollout.colocate else None, resources=dict(cfg.rollout.resources),
        ),
        "reward": RoleResources(cfg.reward.num_workers, cfg.reward.num_cpus_per_worker, 0.0),
    }
    if cfg.rollout.backend == "hybrid":
        del roles["rollout"]
    return roles


class Timer:
    """Accumulates wall time per phase (`with timer("gen"): ...` -> timing_s/gen) and, for the
    phases in COMPUTE_PHASES, the compute seconds the workers measured (`timer.unwrap`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.compute: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def unwrap(self, phase: str, answers: list[Timed[T]]) -> list[T]:
        """The values of one call to several workers at once; adds the slowest worker's compute
        seconds to `phase`, since the driver waits for that one."""
        self.compute[phase] += max((a.compute_s for a in answers), default=0.0)
        return [a.value for a in answers]

    def metrics(self) -> dict[str, float]:
        """timing_s/<phase> (wall) for every phase; for each phase of COMPUTE_PHASES that ran,
        timing_s/<phase>_compute and timing_s/<phase>_overhead (wall - compute: Ray dispatch,
        transfers, driver work inside the phase); timing_s/compute, their sum; and
        timing_s/ray_overhead = timing_s/step - timing_s/compute. With trainer.max_staleness > 0,
        gen's wall time is the wait for a batch generated during earlier steps, so its overhead
        goes negative by the generation it hid."""
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        ran = [p for p in COMPUTE_PHASES if p in self.seconds]
        for phase in ran:
            out[f"timing_s/{phase}_compute"] = self.compute[phase]
            out[f"timing_s/{phase}_overhead"] = self.seconds[phase] - self.compute[phase]
        out["timing_s/compute"] = sum(self.compute[p] for p in ran)
        out["timing_s/ray_overhead"] = self.seconds["step"] - out["timing_s/compute"]
        return out


@dataclasses.dataclass
class Rollouts:
    """Scored responses of the groups kept for training, group by group, and the rewards of every
    response generated for the step (kept or dropped by `algo.filter_zero_std`)."""

    prompts: list[JudgePrompt]  # one a group, or two (data.counterfactual_pairs)
    texts: list[str]  # chat-rendered prompt text per prompt
    completions: list[Completion]  # group_size per group, in prompt order
    rewards: list[RewardResult]
    frac_zero_std: float
    groups_seen: int
    seen: list[RewardResult]  # every scored response of the step: the policy's reward

    def groups(self, group_size: int) -> int:
        return len(self.rewards) // group_size


@dataclasses.dataclass
class Batch:
    """A step's first round of prompts, its generation started (`Trainer.submit_batch`), and the
    sampler's state before it took its items: with batches in flight, a checkpoint records the
    state before the first of them, so a resumed run takes those items again."""

    step: int
    sampler_state: Any
    prompts: list[JudgePrompt]
    texts: list[str]
    generation: PendingGeneration


# A refill round asks for at most this many times the groups still needed.
MAX_REFILL_FACTOR = 4


def refill_size(need: int, kept: int, seen: int) -> int:
    """How many prompts a round of `collect` generates to fill `need` more groups, when `kept` of
    the `seen` groups so far had reward variance: `need` at first, then `need` over the fraction
    kept so far (at most MAX_REFILL_FACTOR x `need`), so that one refill round usually fills the
    step instead of several rounds each adding a few groups."""
    if seen == 0:
        return need
    if kept == 0:
        return need * MAX_REFILL_FACTOR
    return min(need * MAX_REFILL_FACTOR, math.ceil(need * seen / kept))


def overlong(item: JudgeItem, processor: Any, cfg: Config) -> str | None:
    """Why `item` cannot be trained on, when its prompt as the engines see it (chat template,
    image expanded into its tokens under the image budget) leaves less than
    rollout.max_new_tokens within rollout.max_model_len; None when it fits (verl's
    filter_overlong_prompts: vLLM would fail the whole generate call for one such prompt)."""
    prompt = render_batch(item, None, style=cfg.reward.style, shown=tuple(range(len(item.candidates))))
    image = prompt.image if cfg.data.images else None
    text = render_chat(processor, dataclasses.replace(prompt, image=image), think_prefix=cfg.model.think_prefix)
    length = int(processor_inputs(processor, [text], [image])["input_ids"].shape[1])
    if length + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len:
        return None
    return (f"prompt of {length} tokens + rollout.max_new_tokens={cfg.rollout.max_new_tokens} > "
            f"rollout.max_model_len={cfg.rollout.max_model_len} (lower model.max_pixels, or raise max_model_len)")  # fmt: skip


def drop_overlong(rows: Rows[JudgeItem], processor: Any, cfg: Config) -> Rows[JudgeItem]:
    """`rows` without the items that are `overlong`, which move to the rejects with the reason."""
    kept, rejects = [], list(rows.rejects)
    for item in rows.rows:
        reason = overlong(item, processor, cfg)
        if reason is None:
            kept.append(item)
        else:
            rejects.append(RowReject(where=f"{rows.source} item {item.id}", row_id=item.id, reason=reason))
    return Rows(rows.source, kept, rejects)


def load_items(cfg: Config) -> Rows[JudgeItem] | DatasetItems:
    """The training items: a PPJD parquet, a dataset (data.source=hf), or scenes built by the
    PPJD job (rules + oracle), each row checked; fails when more than data.max_reject_fraction
    are bad. A streamed dataset (data.streaming) comes back unread, as `DatasetItems`: its rows
    are checked as the sampler reads them.

    Scene data goes through the same Ray Data job as `pjray ppjd` (on the cluster we are
    connected to), into `<run_dir>/data`; a rerun or resume reuses the shards already there, and
    a new run of the same data settings and code starts from the shards kept on this machine
    (`pjray.ppjd.cache`).
    """
    if cfg.data.source == "hf":
        items = DatasetItems(
            open_dataset(train_ref(cfg.data), cfg.data.streaming), cfg.data.columns, cfg.data.num_candidates, cfg.data.path
        )
        if cfg.data.streaming:
            return items
        rows = items.scan()
        rows.check(cfg.data.max_reject_fraction)
        return rows
    if cfg.data.source == "parquet":
        rows = scan_items(cfg.data.path, cfg.data.num_candidates)
        rows.check(cfg.data.max_reject_fraction)
        return rows
    from pjray.config import PPJDConfig
    from pjray.ppjd import cache as ppjd_cache
    from pjray.ppjd.card import text_only_line
    from pjray.ppjd.pipeline import run_ppjd

    connect(cfg.ray)  # the job runs on the cluster of this training
    out = Path(cfg.trainer.run_dir).resolve() / "data"
    ppjd = PPJDConfig(
        source="scenes", num_items=cfg.data.num_items, image_size=cfg.data.image_size, scene_kinds=cfg.data.scene_kinds,
        scene_objects=cfg.data.scene_objects, scene_split=cfg.data.scene_split, construction=cfg.data.construction,
        num_candidates=cfg.data.num_candidates, perturb_backend="rules", vqa_backend="oracle",
        output_dir=str(out), seed=cfg.data.seed,
    )
    started = time.perf_counter()
    kept = ppjd_cache.restore(ppjd, out)
    manifest = run_ppjd(ppjd)
    seconds = time.perf_counter() - started
    if kept is None:
        ppjd_cache.store(ppjd, out, manifest)
        how = f"built in {seconds:.0f}s ({manifest['counts']['read'] / max(seconds, 1e-9):.0f} rows/s)"
    else:
        how = f"copied from {kept} in {seconds:.1f}s"
    log.info("PPJD scene data: %d kept of %d read, %s, into %s; the text alone ranks them (pjray.ppjd.shortcuts): %s",
             manifest["counts"]["kept"], manifest["counts"]["read"], how, out, text_only_line(manifest["text_only_ranker"]))
    rows = scan_items(out / "ppjd", cfg.data.num_candidates)
    rows.check(cfg.data.max_reject_fraction)
    return rows


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p.parent for p in (run_dir / "checkpoints").glob("global_step_*/COMPLETE")]
    return max(done, key=lambda p: int(p.name.rsplit("_", 1)[1]), default=None)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Trainer:
    def __init__(
        self,
        cfg: Config,
        evaluate: EvalHook | None = None,
        held_out: HeldOutHook | None = None,
        placement_group: PlacementGroup | None = None,
        first_bundle: int = 0,
        on_step: StepHook | None = None,
    ):
        if cfg.eval.every_steps and evaluate is None:
            raise ConfigError("eval.every_steps: this trainer was given no evaluation hook (evaluate=)")
        self.cfg = cfg
        self.evaluate = evaluate
        self.held_out = held_out
        # The actors go into this group from `first_bundle` on (a Ray Tune trial's), else into
        # a group of the training's own (`pjray.placement.Placement`).
        self.placement_group, self.first_bundle = placement_group, first_bundle
        self.on_step = on_step
        self.stalls = StallWatch(cfg.rollout.max_new_tokens)
        self.run_dir = Path(cfg.trainer.run_dir).resolve()
        # trainer.keep_best: the judge of the best validation so far (pjray.rl.best).
        self.best = BestJudge(self.run_dir, cfg.trainer.keep_best, cfg.trainer.keep_best_mode) if cfg.trainer.keep_best else None
        self.step = 0
        self.checkpointed_step = 0  # the step of the newest checkpoint, saved or resumed from
        # The training step whose update the learner's weights hold; the engines hold it after a
        # sync, and stamp it on what they sample (Completion.weight_version).
        self.weight_version = 0
        # Batches whose generation has started, oldest first: the current step's and, with
        # trainer.max_staleness = k, those of up to k steps ahead.
        self.in_flight: deque[Batch] = deque()
        self.hybrid = cfg.rollout.backend == "hybrid"
        # SIGINT / SIGTERM: during set-up they stop at once; in the loop, after the step.
        self.stop = StopRequest()

    # ----------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        clock = PhaseClock(log)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A parquet or dataset is read (a stream opened) before Ray starts: a broken file costs
        # no cluster start-up.
        data = load_items(cfg)
        clock.done("data")
        connect(cfg.ray)
        clock.done("ray")
        self.model_path = self.resolve_model()
        self.processor = load_processor(self.model_path, cfg.model.min_pixels, cfg.model.max_pixels)
        clock.done("judge")
        if isinstance(data, Rows):  # a stream lists its bad rows as it reads them (StreamSampler)
            data = drop_overlong(data, self.processor, cfg)
            data.check(cfg.data.max_reject_fraction)
            write_rejects(data.rejects, self.run_dir / DATA_REJECTS)
            if data.rejects:
                log.warning(
                    "%d of %d training rows skipped (listed in %s), e.g. %s: %s", len(data.rejects),
                    len(data.rows) + len(data.rejects), self.run_dir / DATA_REJECTS, data.rejects[0].where,
                    data.rejects[0].reason,
                )
        self.data = data

        self.placement = Placement(
            training_roles(cfg), strategy=cfg.ray.placement_strategy, timeout_s=cfg.ray.placement_timeout_s,
            group=self.placement_group, first=self.first_bundle,
        )
        clock.done("placement group")
        # The roles start side by side (imports, weights, engines), except engines colocated with
        # the learner ranks: an engine sizes its KV cache from the GPU memory it finds free, so
        # it starts once the ranks hold theirs.
        self.learners = self.launch_learners()
        starting = [r.ready.remote() for r in self.learners]
        self.reward = WorkerPool(
            self.placement, "reward", RewardWorker, lambda i: (cfg.reward, cfg.rollout.max_new_tokens),
            max_retries=cfg.trainer.max_step_retries, wait=False,
        )
        starting += self.reward.ready()
        if self.hybrid:
            self.rollout: WorkerPool | RankGroup = RankGroup(self.learners)
        else:
            if cfg.rollout.colocate:
                ray.get(starting)
            threads = self.placement.threads("rollout", cfg.rollout.num_threads)
            self.rollout = WorkerPool(
                self.placement, "rollout", RolloutWorker,
                lambda i: (self.model_path, cfg.model, cfg.rollout, i, threads[i]),
                max_retries=cfg.trainer.max_step_retries, on_restart=self.sync_worker, wait=False,
            )
            starting += self.rollout.ready()
        ray.get(starting)
        clock.done("learners and workers")
        self.init_weight_sync()
        clock.done("weight sync")

        saved: dict = {}
        resume_from = self.resume_dir()
        if resume_from is not None:
            trainer_state = json.loads((resume_from / "trainer_state.json").read_text())
            ray.get([r.load_checkpoint.remote(str(resume_from / "learner")) for r in self.learners])
            self.step = self.checkpointed_step = self.weight_version = trainer_state["step"]
            saved = trainer_state["sampler"]
            self.sync_weights()
            log.info("resumed from %s at step %d", resume_from, self.step)
            clock.done("resume")
        if isinstance(data, Rows):
            self.sampler = ItemSampler(data.rows, cfg.trainer.seed, SamplerState(**saved))
        else:
            self.sampler = StreamSampler(
                data, StreamState(**saved), self.run_dir / DATA_REJECTS, cfg.data.max_reject_fraction,
                reject=lambda item: overlong(item, self.processor, cfg),
            )
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.tracker = Tracker(
            cfg.tracking, self.run_dir, to_dict(cfg), resume=resume_from is not None, start_step=self.step
        )

    def resolve_model(self) -> str:
        """The judge's path; with none configured, the base judge (shipped, else cached, else
        built) or a tiny random judge built in the run dir, as `model.init` says."""
        if self.cfg.model.path:
            return self.cfg.model.path
        if self.cfg.model.init != "tiny":
            from pjray.recipes.base_judge import RECIPES, base_judge

            return str(base_judge(self.cfg, RECIPES[self.cfg.model.init]))
        from pjray.models.tiny import build_tiny_judge

        target = self.run_dir / "base_model"
        if target.exists():
            return str(target)
        # Built aside and renamed when complete, so an interrupted build is never reused.
        partial = self.run_dir / "base_model.partial"
        shutil.rmtree(partial, ignore_errors=True)
        build_tiny_judge(partial, arch=self.cfg.model.tiny_arch, seed=self.cfg.trainer.seed)
        partial.rename(target)
        return str(target)

    def launch_learners(self) -> list:
        """The learner rank actors, started (their constructors run on; `ready` waits)."""
        cfg = self.cfg
        addr, port = self.placement.master_address("learner")
        port = cfg.learner.master_port or port
        sequences = cfg.trainer.prompts_per_step * cfg.algo.group_size
        per_rank = sequences // (cfg.algo.ppo_mini_batches * cfg.learner.num_ranks)
        total_updates = cfg.trainer.steps * cfg.algo.ppo_mini_batches * cfg.algo.ppo_epochs
        threads = self.placement.threads("learner", cfg.learner.num_threads)
        ranks = [
            self.placement.launch(
                "learner", LearnerRank, r, cfg.model, cfg.learner, cfg.algo, self.model_path,
                rank=r, world_size=cfg.learner.num_ranks, master_addr=addr, master_port=port,
                total_steps=total_updates, grad_accum_steps=per_rank // cfg.learner.micro_batch_size,
                norm_len=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                num_threads=threads[r], rollout_cfg=cfg.rollout if self.hybrid else None,
            )
            for r in range(cfg.learner.num_ranks)
        ]
        return ranks

    def resume_dir(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume == "disable":
            return None
        if resume == "auto":
            return latest_checkpoint(self.run_dir)
        path = Path(resume)
        if not (path / "COMPLETE").exists():
            raise FileNotFoundError(f"trainer.resume={resume}: not a complete checkpoint directory")
        return path

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
            if self.held_out is not None and not self.cfg.model.path and self.cfg.model.init != "tiny":
                self.held_out_check()

    def held_out_check(self) -> None:
        """The run's judge against the base judge it started from on scenes held out by content
        from both judges' training items (`self.held_out`), written to held_out.json, with one
        row per judge and item in held_out_items.parquet; `pjray train` prints it at the end. The same prompts for both, so the difference is what the run
        learned, free of its reward curve's noise."""
        assert self.held_out is not None
        items = self.data.rows if isinstance(self.data, Rows) else []
        started = time.perf_counter()
        result = self.held_out(self.model_path, str(self.run_dir / "hf_model"), items)
        verdicts = result.pop("verdicts")
        pq.write_table(pa.Table.from_pylist(verdicts), self.run_dir / HELD_OUT_ITEMS)
        (self.run_dir / HELD_OUT).write_text(json.dumps(result, indent=2))
        log.info("held-out check: %.1fs, written to %s (per item: %s)", time.perf_counter() - started,
                 self.run_dir / HELD_OUT, HELD_OUT_ITEMS)  # fmt: skip

    def loop(self) -> None:
        cfg = self.cfg.trainer
        started, first_step = time.perf_counter(), self.step
        while self.step < cfg.steps and not self.stop.requested:
            self.step += 1
            metrics = self.train_step()
            if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                # Held-out metrics (eval/*), judged by the rollout pool (the hook is checked in __init__).
                metrics.update(self.evaluate(self.cfg, self.judge_texts, self.step))
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
        rollouts = self.collect(timer)
        stale = self.staleness(rollouts.completions)
        if max(stale, default=0) > self.cfg.trainer.max_staleness:
            raise RuntimeError(f"step {self.step}: a sample {max(stale)} weight versions old, over "
                               f"trainer.max_staleness={self.cfg.trainer.max_staleness}")  # fmt: skip
        if self.cfg.rollout.colocate:
            # Colocated vLLM hands its GPU memory to the learner until the next sync wakes it.
            with timer("sleep"):
                self.rollout.broadcast("sleep")

        # Group-relative advantages over the kept groups.
        with timer("adv"):
            rewards = torch.tensor([r.total for r in rollouts.rewards], dtype=torch.float32)
            advantages = group_advantages(
                rewards, self.cfg.algo.group_size, norm_by_std=self.cfg.algo.norm_adv_by_std,
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

        # Send the new weights to every rollout engine.
        with timer("sync"):
            self.sync_weights()

        timer.seconds["step"] = time.perf_counter() - start
        metrics = self.step_metrics(rollouts, advantages, actor_metrics, timer)
        metrics["rollout/staleness_mean"] = mean([float(v) for v in stale])
        metrics["rollout/staleness_max"] = float(max(stale, default=0))
        return {**metrics, **self.memory_metrics()}

    def staleness(self, completions: list[Completion]) -> list[int]:
        """Weight versions between the learner's weights now and those that sampled each
        completion (the hybrid engine samples with the learner's own: 0)."""
        if self.hybrid:
            return [0] * len(completions)
        return [self.weight_version - c.weight_version for c in completions]

    def memory_metrics(self) -> dict[str, float]:
        """memory/<role>_peak_mib (host RSS, the largest actor of the role) and, where a role
        uses a GPU, memory/<role>_gpu_peak_mib, so far in the run; the driver's own too. With the
        hybrid engine the learner ranks are the rollout role."""
        roles = {"learner": self.learners, "reward": self.reward.actors}
        if not self.hybrid:
            roles["rollout"] = self.rollout.actors
        names = [role for role, actors in roles.items() for _ in actors]
        answers = ray.get([a.peak_memory.remote() for actors in roles.values() for a in actors])
        peaks = {"driver": peak_memory_mib()}
        for role, answer in zip(names, answers):
            peaks[role] = {k: max(v, peaks.get(role, {}).get(k, 0.0)) for k, v in answer.items()}
        metrics = {}
        for role, peak in peaks.items():
            metrics[f"memory/{role}_peak_mib"] = peak["host"]
            if peak["gpu"]:
                metrics[f"memory/{role}_gpu_peak_mib"] = peak["gpu"]
        return metrics

    # ----------------------------------------------------------------------------- phases
    def collect(self, timer: Timer) -> Rollouts:
        cfg = self.cfg
        n, want, shown = cfg.algo.group_size, cfg.trainer.prompts_per_step, self.prompts_per_group
        rounds = 1 + (cfg.algo.max_refill_rounds if cfg.algo.filter_zero_std else 0)
        kept = Rollouts([], [], [], [], 0.0, 0, [])
        zero_groups = 0
        for round_index in range(rounds):
            need = refill_size(want - kept.groups(n), kept.groups(n), kept.groups_seen)
            with timer("gen"):
                if round_index == 0:
                    batch = self.next_batch()
                    prompts, texts = batch.prompts, batch.texts
                    completions = timer.unwrap("gen", [batch.generation.result()])[0]
                else:
                    prompts, texts, completions = self.generate(need, seed=self.step * 1_000 + round_index, timer=timer)
            with timer("reward"):
                results = self.score(prompts, texts, completions, timer)
            with timer("adv"):
                zero = zero_std_groups(torch.tensor([r.total for r in results]), n).tolist()
            zero_groups += sum(zero)
            kept.groups_seen += len(zero)
            kept.seen.extend(results)
            for g in range(len(zero)):
                if cfg.algo.filter_zero_std and zero[g]:
                    continue
                kept.prompts.extend(prompts[g * shown : (g + 1) * shown])
                kept.texts.extend(texts[g * shown : (g + 1) * shown])
                kept.completions.extend(completions[g * n : (g + 1) * n])
                kept.rewards.extend(results[g * n : (g + 1) * n])
            if kept.groups(n) >= want:
                break
        # A refill round may overshoot; keep exactly the configured number of groups.
        del kept.prompts[want * shown :], kept.texts[want * shown :], kept.completions[want * n :], kept.rewards[want * n :]
        kept.frac_zero_std = zero_groups / kept.groups_seen
        if not kept.prompts:
            # Every group was degenerate: train on nothing this step but keep the run alive.
            log.warning("step %d: every group had zero reward variance", self.step)
        return kept

    @property
    def prompts_per_group(self) -> int:
        """Prompts a GRPO group holds: one, or with data.counterfactual_pairs the tuple on its
        image and on its swapped image, each with half the group's responses."""
        return 2 if self.cfg.data.counterfactual_pairs else 1

    def next_batch(self) -> Batch:
        """This step's batch: first the generation of every step up to `max_staleness` ahead is
        started (each samples with the weights its workers hold when it reaches them: a sync
        queued behind it waits for it), then the oldest batch, this step's, is handed out."""
        last = self.in_flight[-1].step if self.in_flight else self.step - 1
        for step in range(last + 1, min(self.step + self.cfg.trainer.max_staleness, self.cfg.trainer.steps) + 1):
            self.in_flight.append(self.submit_batch(step))
        batch = self.in_flight.popleft()
        assert batch.step == self.step, (batch.step, self.step)
        return batch

    def submit_batch(self, step: int) -> Batch:
        """Take a step's items and start generating their groups."""
        state = copy.deepcopy(self.sampler.state)
        prompts, texts = self.sample_prompts(self.cfg.trainer.prompts_per_step)
        n = self.cfg.algo.group_size // self.prompts_per_group
        return Batch(step, state, prompts, texts, submit_generation(self.rollout, prompts, n, seed=step * 1_000))

    def trained_state(self) -> Any:
        """The sampler's state after the items of the batches trained on so far: the state before
        the oldest batch in flight, if any."""
        return self.in_flight[0].sampler_state if self.in_flight else self.sampler.state

    def generate(
        self, num_groups: int, seed: int, timer: Timer
    ) -> tuple[list[JudgePrompt], list[str], list[Completion]]:
        """`sample_prompts` and generate a group's responses for each, now."""
        prompts, texts = self.sample_prompts(num_groups)
        answer = generate_with_pool(self.rollout, prompts, self.cfg.algo.group_size // self.prompts_per_group, seed)
        return prompts, texts, timer.unwrap("gen", [answer])[0]

    def sample_prompts(self, num_groups: int) -> tuple[list[JudgePrompt], list[str]]:
        """Sample items and render prompts (candidates in the stream's balanced orders,
        `shown_order`), group by group (with counterfactual pairs two prompts a group, the same
        letters on both images), with each prompt's chat text as the engines and the learner
        render it."""
        prompts = []
        for index, item in self.sampler.take(num_groups):
            shown = shown_order(index, len(item.candidates), self.cfg.trainer.seed)
            for it in counterfactual_pair(item) if self.cfg.data.counterfactual_pairs else (item,):
                prompt = render_batch(it, None, style=self.cfg.reward.style, shown=shown)
                # data.images=false: a text-only judge (validated against the model in config).
                prompts.append(prompt if self.cfg.data.images else dataclasses.replace(prompt, image=None))
        texts = [render_chat(self.processor, p, think_prefix=self.cfg.model.think_prefix) for p in prompts]
        return prompts, texts

    def judge_texts(self, prompts: list[JudgePrompt], seed: int) -> list[str]:
        """One response text per prompt from the rollout workers: the evaluation hook's generate."""
        return [c.text for c in generate_with_pool(self.rollout, prompts, 1, seed).value]

    def score(
        self, prompts: list[JudgePrompt], texts: list[str], completions: list[Completion], timer: Timer
    ) -> list[RewardResult]:
        targets = [prompts[c.prompt_index].target for c in completions]
        # Whether a response must open <think> itself is read from its prompt's text: a chat
        # template may open the block whatever model.think_prefix says.
        prefilled = [opens_think(texts[c.prompt_index]) for c in completions]
        chunks = split_evenly(range(len(completions)), len(self.reward))
        answers = self.reward.call(
            "score_timed",
            [([completions[i] for i in chunk], [targets[i] for i in chunk], [prefilled[i] for i in chunk]) for chunk in chunks],
        )
        results = timer.unwrap("reward", answers)
        return [r for chunk_results in results for r in chunk_results]

    def experiences(self, rollouts: Rollouts, advantages: list[float]) -> list[Experience]:
        n = self.cfg.algo.group_size // self.prompts_per_group  # responses a prompt
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

    def init_weight_sync(self) -> None:
        """Choose the weight transport once (`trainer.sync_backend`; `auto` from the layout,
        `pjray.sync.transports.auto_transport`) and set it up."""
        cfg = self.cfg
        bucket_bytes, tp = cfg.trainer.sync_bucket_mb << 20, cfg.rollout.tensor_parallel_size
        if self.hybrid:
            self.transport = make_transport("none", bucket_bytes)
            log.info("weight sync: none (rollout.backend=hybrid: the learner ranks generate with the weights they train)")
            return
        name = cfg.trainer.sync_backend
        if name == "auto":
            learner_node = ray.get(self.learners[0].node_id.remote())
            workers = ray.get([w.node_id.remote() for w in self.rollout.actors])
            name = auto_transport(cfg.rollout, cfg.learner.num_gpus_per_rank > 0, learner_node, workers)
            log.info(
                "weight sync: %s (trainer.sync_backend=auto; learner rank 0 on node %s, rollout workers on %s)",
                name, learner_node[:8], [w[:8] for w in workers],
            )  # fmt: skip
        self.transport = make_transport(name, bucket_bytes, tp)
        self.transport.connect(self.learners, self.rollout)

    def sync_weights(self) -> None:
        """Bucketed learner -> rollout weight transfer over the chosen transport
        (`pjray.sync.transports`). Every learner rank takes part (ZeRO-3).

        Colocated, GPU memory changes hands in this order: the learners return their allocator's
        cached blocks, the sleeping engines wake their weights and load, the learners free their
        two stream buffers, and only then do the engines wake their KV caches."""
        colocated = self.cfg.rollout.colocate
        if colocated:
            ray.get([r.release_memory.remote() for r in self.learners])
        self.transport.send(self.learners, self.rollout)
        if not self.hybrid:
            self.rollout.broadcast("set_weight_version", self.weight_version)
        if colocated:
            self.rollout.broadcast("wake_up")

    def sync_worker(self, worker) -> None:
        """Bring one rebuilt rollout worker to the learner's current weights."""
        self.transport.refresh(self.learners, self.rollout, worker)
        ray.get(worker.set_weight_version.remote(self.weight_version))

    # ----------------------------------------------------------------------------- outputs
    def step_metrics(self, rollouts: Rollouts, advantages: torch.Tensor, actor: dict[str, float], timer: Timer) -> dict[str, float]:
        # reward/*: every response generated for the step, what the policy earns; with
        # algo.filter_zero_std the groups trained on are a biased subset (reward/kept_mean).
        totals = [r.total for r in rollouts.seen]
        lengths = [len(c.token_ids) for c in rollouts.completions]
        tokens = sum(lengths)
        metrics = {
            "reward/mean": mean(totals),
            "reward/std": float(torch.tensor(totals).std()) if len(totals) > 1 else 0.0,
            "reward/format_mean": mean([r.format for r in rollouts.seen]),
            "reward/ranking_mean": mean([r.ranking for r in rollouts.seen]),
            "reward/kept_mean": mean([r.total for r in rollouts.rewards]),
            "rollout/frac_zero_std": rollouts.frac_zero_std,
            "rollout/groups_kept": float(rollouts.groups(self.cfg.algo.group_size)),
            "rollout/groups_seen": float(rollouts.groups_seen),
            "rollout/worker_restarts": float(self.rollout.restarts + self.reward.restarts),
            "response_length/mean": mean(lengths),
            "response_length/max": float(max(lengths, default=0)),
            "response_length/clip_ratio": mean([float(c.finish_reason == "length") for c in rollouts.completions]),
            "advantages/mean": float(advantages.mean()) if advantages.numel() else 0.0,
            "advantages/max": float(advantages.max()) if advantages.numel() else 0.0,
            "advantages/min": float(advantages.min()) if advantages.numel() else 0.0,
            "data/consumed": float(self.trained_state().consumed),
            "data/rejected": float(self.rejected_rows()),
            "data/epoch": float(self.sampler.epoch),
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / timer.seconds["step"],
            "training/global_step": float(self.step),
        }
        metrics.update(actor)
        metrics.update(timer.metrics())
        return metrics

    def rejected_rows(self) -> int:
        """Training rows skipped as unusable: all of them, or those a stream has read so far."""
        return len(self.data.rejects) if isinstance(self.data, Rows) else self.sampler.state.rejected

    def save_checkpoint(self) -> None:
        cfg = self.cfg.trainer
        path = self.run_dir / "checkpoints" / f"global_step_{self.step}"
        ray.get([r.save_checkpoint.remote(str(path / "learner"), {"step": self.step}) for r in self.learners])
        state = {"step": self.step, "sampler": dataclasses.asdict(self.trained_state()), "seed": cfg.seed}
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / "COMPLETE").touch()  # written last: a checkpoint without it is ignored by resume
        self.checkpointed_step = self.step
        done = sorted(
            (p.parent for p in (self.run_dir / "checkpoints").glob("global_step_*/COMPLETE")),
            key=lambda p: int(p.name.rsplit("_", 1)[1]),
        )
        for old in done[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def export_hf(self, path: Path | None = None) -> Path:
        """The judge as an HF directory (default: <run_dir>/hf_model)."""
        path = path or self.run_dir / "hf_model"
        ray.get([r.save_hf.remote(str(path)) for r in self.learners])
        return path

    def shutdown(self) -> None:
        if hasattr(self, "tracker"):
            self.tracker.close()
        if hasattr(self, "placement"):
            if hasattr(self, "transport"):
                self.transport.close(self.learners)
            self.placement.shutdown()  # every learner, rollout and reward actor


def train(
    cfg: Config,
    evaluate: EvalHook | None = None,
    held_out: HeldOutHook | None = None,
    placement_group: PlacementGroup | None = None,
    first_bundle: int = 0,
    on_step: StepHook | None = None,
) -> Path:
    """Run a whole training job (with `evaluate` every eval.every_steps, `held_out` at the end of
    a run from the base judge, `on_step` after every step, its actors in `placement_group` from
    `first_bundle` on if one is given); returns the run directory."""
    trainer = Trainer(cfg, evaluate, held_out, placement_group, first_bundle, on_step)
    with trainer.stop:
        try:
            trainer.setup()
            trainer.run()
        finally:
            trainer.shutdown()
    return trainer.run_dir
