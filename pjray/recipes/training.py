"""What `pjray train` resolves before the trainer starts: the judge to train and the training rows.

The trainer receives paths (`pjray.types.TrainInputs`) and never launches a job or a build; this
module does both, saying what it does and how long it takes:

* the judge: `model.path`; else the base judge of `model.init` (shipped, cached, or built into the
  cache: `pjray.recipes.base_judge`); else (`model.init=tiny`) a tiny random judge built in the
  run directory;
* the rows: `data.path` (a PPJD parquet or a dataset); else (`data.source=scenes`) the PPJD Ray Data
  job on synthetic scenes (rules + oracle), into `<run_dir>/data` on the cluster of this training.
  A rerun or resume reuses the shards already there, and a new run of the same data settings and
  code starts from the shards kept on this machine (`pjray.ppjd.cache`). A policy's scenes
  (task.kind=policy) need no job: they are questions made from data.* as the trainer reads them;
* a policy's judge (reward.judge.model): the shipped base judge, a directory (a run's export), or
  a hub id (a path that is not there fails before, in `pjray.inputs`, in one line).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pjray.cluster import connect
from pjray.config import Config, PPJDConfig
from pjray.types import TrainInputs

log = logging.getLogger(__name__)

Say = Callable[[str], None]


def training_inputs(cfg: Config, say: Say = log.info) -> TrainInputs:
    """The judge and the rows of the training `cfg` describes, built where they must be."""
    if cfg.data.source in ("parquet", "hf"):
        items = cfg.data.path
    else:
        items = str(scene_data(cfg, say)) if cfg.task.kind == "judge" else ""
    model, base = judge(cfg, say)
    if cfg.task.kind == "judge":
        return TrainInputs(model=model, items=items, base_judge=base)
    reward_judge = policy_judge(cfg, say) if cfg.reward.source != "rule" else ""
    return TrainInputs(model=model, items=items, base_judge=False, judge=reward_judge)


def policy_judge(cfg: Config, say: Say) -> str:
    """The judge of a policy's reward (reward.judge.model): "shipped", the base judge pjray ships
    (its weights checked against its record); else a model directory or a hub id, as
    `pjray.inputs.check_inputs` found it."""
    name = cfg.reward.judge.model
    if name == "shipped":
        from pjray.recipes.base_judge import SHIPPED, shipped_record

        shipped_record()
        path = str(SHIPPED / "hf_model")
        say(f"pjray: reward judge: the shipped base judge, {path}")
        return path
    # Checked by pjray.inputs.check_inputs before the run: a model directory or a hub id.
    resolved = str(Path(name).resolve()) if Path(name).is_dir() else name
    say(f"pjray: reward judge: {resolved}")
    return resolved


def judge(cfg: Config, say: Say) -> tuple[str, bool]:
    """The judge to train, and whether it is a base judge of pjray's recipes."""
    if cfg.model.path:
        return cfg.model.path, False
    if cfg.model.init == "base_policy":
        from pjray.recipes.base_policy import base_policy

        path = base_policy(cfg, log=say)
        say(f"pjray: policy: {path} (model.init=base_policy)")
        return str(path), False
    if cfg.model.init != "tiny":
        from pjray.recipes.base_judge import RECIPES, base_judge

        path = base_judge(cfg, RECIPES[cfg.model.init], log=say)
        say(f"pjray: judge: {path} (model.init={cfg.model.init})")
        return str(path), True
    return str(tiny_judge(cfg, say)), False


def tiny_judge(cfg: Config, say: Say) -> Path:
    """A tiny random judge (`model.tiny_arch`, seeded by trainer.seed) in `<run_dir>/base_model`,
    built aside and renamed when complete, so an interrupted build is never reused."""
    from pjray.models.tiny import build_tiny_judge
    from pjray.models.tiny_families import FAMILY_ARCHS, build_tiny_family_judge

    target = Path(cfg.trainer.run_dir).resolve() / "base_model"
    if target.exists():
        return target
    started = time.perf_counter()
    partial = target.with_name("base_model.partial")
    shutil.rmtree(partial, ignore_errors=True)
    build = build_tiny_family_judge if cfg.model.tiny_arch in FAMILY_ARCHS else build_tiny_judge
    build(partial, arch=cfg.model.tiny_arch, seed=cfg.trainer.seed)
    partial.rename(target)
    say(
        f"pjray: judge: a tiny random {cfg.model.tiny_arch} judge built in {time.perf_counter() - started:.1f}s, {target}"
    )
    return target


def scene_data(cfg: Config, say: Say) -> Path:
    """The PPJD rows of `data.*`'s scenes, built (or reused) by the PPJD job into `<run_dir>/data`."""
    from pjray.ppjd import cache as ppjd_cache
    from pjray.ppjd.card import text_only_line
    from pjray.ppjd.pipeline import run_ppjd

    out = Path(cfg.trainer.run_dir).resolve() / "data"
    d = cfg.data
    ppjd = PPJDConfig(
        source="scenes",
        num_items=d.num_items,
        image_size=d.image_size,
        scene_kinds=d.scene_kinds,
        scene_objects=d.scene_objects,
        scene_split=d.scene_split,
        construction=d.construction,
        num_candidates=d.num_candidates,
        perturb_backend="rules",
        vqa_backend="oracle",
        output_dir=str(out),
        seed=d.seed,
    )
    say(
        f"pjray: data: {d.num_items} scene items through the PPJD job (Ray Data, rules + oracle) into {out}; "
        "shards already there or kept for these settings are reused; a fresh build takes about 10 s per 100 items on 2 cores"
    )
    connect(cfg.ray)  # the job runs on the cluster of this training
    started = time.perf_counter()
    kept = ppjd_cache.restore(ppjd, out)
    manifest = run_ppjd(ppjd)
    seconds = time.perf_counter() - started
    if kept is None:
        ppjd_cache.store(ppjd, out, manifest)
        how = f"built in {seconds:.0f}s ({manifest['counts']['read'] / max(seconds, 1e-9):.0f} rows/s)"
    else:
        how = f"copied from {kept} in {seconds:.1f}s"
    say(
        f"pjray: data: {manifest['counts']['kept']} kept of {manifest['counts']['read']} read, {how}; the text alone "
        f"ranks them (pjray.ppjd.shortcuts): {text_only_line(manifest['text_only_ranker'])}"
    )
    return out / "ppjd"
