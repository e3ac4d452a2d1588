"""`pjray ppjd`: the Perceptually Perturbed Judgment Dataset job on Ray Data.

    read (driver) -> shards -> load -> verify -> extract -> perturb -> check -> vqa -> decontam -> write

Every stage (`pjray.ppjd.stages`) is a `map_batches` over pandas batches of work rows
(`build_dataset`). A row that fails a stage rides along untouched to the write stage, which
files it with its reason in the rejects file: nothing is dropped silently; a shard in which one
stage rejected too many rows fails the job (`check_reject_rates`).

Resume: the source rows are cut into numbered shards of `ppjd.shard_size` rows, each written
whole, its `ppjd/` file last (`ShardWriter`): a shard whose `ppjd/` file exists is skipped on a
rerun. `job.json` pins the config that made the shards; a rerun with another is refused rather
than mixing two datasets.

Output (`ppjd.output_dir`):
    ppjd/shard-XXXXX.parquet     PPJD rows (pjray.data.sources.PPJD_SCHEMA), `read_items` reads it
    rejects/shard-XXXXX.parquet  id, source, where, reject_stage, reject_reason, question
    stats/shard-XXXXX.json       per-shard counts and stage seconds
    manifest.json                counts per stage, per-stage throughput, the text-only ranker audit
                                 (pjray.ppjd.shortcuts) of every written row, the config
    README.md                    the dataset card (pjray.ppjd.card): `datasets.load_dataset(output_dir)`
                                 or `load_dataset("parquet", data_dir=output_dir/ppjd)` reads the rows
With `ppjd.push_to_hub` the finished dataset and its card are published to that hub dataset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pjray.cache import atomic_write
from pjray.cluster import connect
from pjray.config import Config, ConfigError, PPJDConfig, RayConfig, to_dict
from pjray.console import quiet_ray_data
from pjray.data.sources import items_to_table
from pjray.ppjd.card import dataset_card, push_to_hub, text_only_line
from pjray.ppjd.rejects import RejectRateError
from pjray.ppjd.shortcuts import audit
from pjray.ppjd.sources import RawRow, read_source
from pjray.ppjd.stages import (
    MIN_ROWS_CHECKED,
    REJECT_SCHEMA,
    STAGES,
    WORK_COLUMNS,
    CpuStages,
    LlmStage,
    VlmStage,
    to_item,
)
from pjray.ppjd.verify import EvalIndex, load_eval_index
from pjray.types import JudgeItem

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- write


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


class ShardWriter:
    """The write stage: one whole shard per batch -> ppjd / rejects / stats files.

    It writes `rejects/`, `stats/` and last `ppjd/shard-XXXXX.parquet`, each to a temporary name
    and then renamed, so the PPJD file's existence marks the shard done and a crash loses only
    the shards in flight. A shard that fails `check_reject_rates` keeps its rejects and stats,
    for the diagnosis, but gets no PPJD file."""

    def __init__(self, output_dir: str, num_candidates: int, max_reject_fraction: float) -> None:
        self.out, self.num_candidates = Path(output_dir), num_candidates
        self.max_reject_fraction = max_reject_fraction

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        summaries = []
        for shard, group in batch.groupby("shard", sort=True):
            rows = group.to_dict("records")
            if len(rows) != int(rows[0]["shard_rows"]):
                # Blocks must stay whole shards; a split block would write a partial shard as done.
                raise RuntimeError(
                    f"{shard_name(int(shard))}: got {len(rows)} of {rows[0]['shard_rows']} rows in one batch"
                )
            summaries.append(self.write_shard(int(shard), rows))
        return pd.DataFrame({"stats": summaries})

    def write_shard(self, shard: int, rows: list[dict[str, Any]]) -> str:
        start = time.perf_counter()
        kept, rejects = [], []
        for row in rows:
            if row["reject_stage"]:
                rejects.append({k: row[k] for k in REJECT_SCHEMA.names})
            else:
                kept.append(to_item(row, self.num_candidates))
        seconds: dict[str, float] = {}
        for row in rows:
            for stage, s in json.loads(row["stage_seconds"]).items():
                seconds[stage] = seconds.get(stage, 0.0) + s
        by_stage: dict[str, int] = {}
        for r in rejects:
            by_stage[r["reject_stage"]] = by_stage.get(r["reject_stage"], 0) + 1
        stats = {
            "shard": shard,
            "read": len(rows),
            "kept": len(kept),
            "rejected": len(rejects),
            "rejected_by_stage": by_stage,
            "stage_seconds": seconds,
        }
        name = shard_name(shard)
        seconds["write"] = time.perf_counter() - start  # the files below are not counted
        # Rejects and stats first, the PPJD shard last: its existence marks the shard done.
        atomic_write(
            self.out / "rejects" / f"{name}.parquet",
            lambda p: pq.write_table(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA), p),
        )
        atomic_write(self.out / "stats" / f"{name}.json", lambda p: p.write_text(json.dumps(stats)))
        check_reject_rates(name, len(rows), rejects, self.max_reject_fraction)
        atomic_write(self.out / "ppjd" / f"{name}.parquet", lambda p: pq.write_table(items_to_table(kept), p))
        return json.dumps(stats)


def check_reject_rates(shard: str, num_rows: int, rejects: list[dict[str, Any]], max_fraction: float) -> None:
    """Raise `RejectRateError` when a stage rejected more than `max_fraction` of the rows of the
    shard that reached it (stages reached by fewer than MIN_ROWS_CHECKED rows are not judged),
    naming the stage and its most frequent reasons."""
    alive = num_rows
    for stage in (*STAGES, "write"):
        reasons = Counter(r["reject_reason"] for r in rejects if r["reject_stage"] == stage)
        dropped = sum(reasons.values())
        if alive >= MIN_ROWS_CHECKED and dropped > max_fraction * alive:
            top = "; ".join(f"{n} x {reason[:160]!r}" for reason, n in reasons.most_common(3))
            raise RejectRateError(
                f"{shard}: stage {stage!r} rejected {dropped} of the {alive} rows that reached it "
                f"(more than ppjd.max_reject_fraction={max_fraction:g}); top reasons: {top}. A stage "
                "that rejects nearly everything is more likely broken or misconfigured than fed bad "
                "data; the shard's rejects are in rejects/, and no PPJD file was written for it"
            )
        alive -= dropped


# --------------------------------------------------------------------------- the job


def job_fingerprint(cfg: PPJDConfig) -> dict[str, Any]:
    """The settings that decide which rows land in which shard and what they hold."""
    d = asdict(cfg)
    for key in (
        "llm_workers",
        "vlm_workers",
        "num_cpus_per_actor",
        "num_gpus_per_actor",
        "output_dir",
        "max_reject_fraction",
        "license",
        "push_to_hub",
    ):
        d.pop(key)  # scaling knobs, the guard and publishing: changing them must not invalidate finished shards
    return d


def _check_job(out: Path, cfg: PPJDConfig) -> None:
    job = out / "job.json"
    fingerprint = job_fingerprint(cfg)
    if job.exists():
        previous = json.loads(job.read_text())
        if previous != fingerprint:
            diff = sorted(k for k in fingerprint if previous.get(k) != fingerprint[k])
            raise ConfigError(
                f"ppjd.output_dir: {out}: holds shards of a different ppjd config (differs in {', '.join(diff)}); "
                "use a new ppjd.output_dir or delete this one"
            )
    else:
        atomic_write(job, lambda p: p.write_text(json.dumps(fingerprint, indent=2)))


def _shards(rows: list[RawRow], size: int) -> list[list[RawRow]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def build_dataset(frames: list[pd.DataFrame], cfg: PPJDConfig, eval_index: EvalIndex):
    """The lazy Ray Dataset of the whole job over `frames` (one pandas frame per pending shard).

    Each shard is one Ray block and every batch a whole block (`batch_size=None`), so the write
    stage sees each shard whole. Model stages run on actor pools (`ActorPoolStrategy`) sized by
    `ppjd.llm_workers` / `ppjd.vlm_workers`, each actor holding `ppjd.num_gpus_per_actor` GPUs or
    `ppjd.num_cpus_per_actor` (fractional) CPUs. With the llm backend, verify, extract and perturb
    share one actor (one model copy): the three prompt roles run back to back on a batch."""
    import ray.data

    quiet_ray_data()
    stages = CpuStages(cfg, eval_index)
    common = {"batch_format": "pandas", "batch_size": None}
    actor = {
        "num_cpus": cfg.num_cpus_per_actor if cfg.num_gpus_per_actor <= 0 else None,
        "num_gpus": cfg.num_gpus_per_actor or None,
    }
    actor = {k: v for k, v in actor.items() if v is not None}
    ds = ray.data.from_pandas(frames).map_batches(stages.load, **common)
    if cfg.perturb_backend == "llm":
        ds = ds.map_batches(
            LlmStage,
            fn_constructor_args=(cfg,),
            compute=ray.data.ActorPoolStrategy(size=cfg.llm_workers),
            **actor,
            **common,
        )
    else:
        ds = ds.map_batches(stages.verify, **common).map_batches(stages.extract, **common)
        ds = ds.map_batches(stages.perturb, **common)
    ds = ds.map_batches(stages.check, **common)
    if cfg.vqa_backend == "vlm":
        ds = ds.map_batches(
            VlmStage,
            fn_constructor_args=(cfg,),
            compute=ray.data.ActorPoolStrategy(size=cfg.vlm_workers),
            **actor,
            **common,
        )
    else:
        ds = ds.map_batches(stages.vqa, **common)
    ds = ds.map_batches(stages.decontam, **common)
    ds = ds.map_batches(ShardWriter(cfg.output_dir, cfg.num_candidates, cfg.max_reject_fraction), **common)
    if cfg.perturb_backend != "llm" and cfg.vqa_backend != "vlm":
        # Model-free plans fuse into one task operator. Ray Data's per-operator reservation then
        # holds it to one task at a time until its first outputs come back, which slows the job
        # (benchmarks/results/design_notes.md). Plans with actor pools keep it: there it stops
        # the CPU stages from starving the model stages.
        ds.context.op_resource_reservation_enabled = False
    return ds


def _frame(shard: int, rows: list[RawRow]) -> pd.DataFrame:
    records = []
    for r in rows:
        d = r.to_dict()
        d.update(attrs="[]", levels="[]", probes="[]", stage_seconds="{}", shard=shard, shard_rows=len(rows))
        if d["reject_stage"]:
            d["stage_seconds"] = json.dumps({"read": 0.0})
        records.append(d)
    return pd.DataFrame(records, columns=list(WORK_COLUMNS))


def run_ppjd(cfg: Config | PPJDConfig, config_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run (or finish) the job into `ppjd.output_dir` on the Ray cluster (`pjray.cluster.connect`,
    with `cfg.ray` for a whole Config); returns the manifest."""
    p = cfg.ppjd if isinstance(cfg, Config) else cfg
    if config_dict is None:
        config_dict = to_dict(cfg)["ppjd"] if isinstance(cfg, Config) else asdict(p)
    # Absolute, because the write stage runs in Ray workers whose working directory is not ours
    # (on a multi-node cluster the directory must be on storage every node mounts).
    out = Path(p.output_dir).resolve()
    p = replace(p, output_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    _check_job(out, p)

    start = time.perf_counter()
    rows = read_source(
        p.source, p.paths, p.num_items, p.seed, p.image_size, p.scene_kinds, p.scene_objects, p.scene_split
    )
    shards = _shards(rows, p.shard_size)
    pending = [i for i in range(len(shards)) if not (out / "ppjd" / f"{shard_name(i)}.parquet").exists()]
    log.info(
        "ppjd: %d rows in %d shards, %d to do, %d already written",
        len(rows),
        len(shards),
        len(pending),
        len(shards) - len(pending),
    )
    eval_index = load_eval_index(p.decontam_files) if p.decontam_files else EvalIndex((), frozenset())
    if pending:
        connect(cfg.ray if isinstance(cfg, Config) else RayConfig())
        ds = build_dataset([_frame(i, shards[i]) for i in pending], p, eval_index)
        todo, rows_done, started = sum(len(shards[i]) for i in pending), 0, time.perf_counter()
        for done, row in enumerate(ds.iter_rows(), start=1):
            stats = json.loads(row["stats"])
            rows_done += stats["read"]
            rate = rows_done / max(time.perf_counter() - started, 1e-9)
            log.info(
                "ppjd: %s written (%d kept, %d rejected) [%d/%d shards, %d/%d rows, %.1f rows/s]",
                shard_name(stats["shard"]),
                stats["kept"],
                stats["rejected"],
                done,
                len(pending),
                rows_done,
                todo,
                rate,
            )
    wall = time.perf_counter() - start
    processed = sum(len(shards[i]) for i in pending)
    manifest = build_manifest(out, len(shards), len(pending), processed, wall, config_dict)
    atomic_write(out / "manifest.json", lambda f: f.write_text(json.dumps(manifest, indent=2)))
    atomic_write(out / "README.md", lambda f: dataset_card(out, manifest).save(f))
    if p.push_to_hub:
        push_to_hub(out, p.push_to_hub)
    return manifest


def build_manifest(
    out: Path, num_shards: int, written: int, processed: int, wall: float, config: dict[str, Any]
) -> dict[str, Any]:
    """Counts per stage and throughput over every finished shard (this run's and earlier ones)."""
    stats = [
        json.loads(f.read_text())
        for f in sorted((out / "stats").glob("shard-*.json"))
        if (out / "ppjd" / f"{f.stem}.parquet").exists()
    ]
    read = sum(s["read"] for s in stats)
    rejected_by_stage: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for s in stats:
        for stage, n in s["rejected_by_stage"].items():
            rejected_by_stage[stage] = rejected_by_stage.get(stage, 0) + n
        for stage, t in s["stage_seconds"].items():
            seconds[stage] = seconds.get(stage, 0.0) + t
    per_stage, alive = {}, read
    for stage in (*STAGES, "write"):
        dropped = rejected_by_stage.get(stage, 0)
        entry: dict[str, Any] = {"in": alive, "rejected": dropped, "out": alive - dropped}
        if seconds.get(stage):
            entry["seconds"] = round(seconds[stage], 4)
            entry["rows_per_s_per_worker"] = round(alive / seconds[stage], 2) if seconds[stage] > 0 else None
        per_stage[stage] = entry
        alive -= dropped
    kept = sum(s["kept"] for s in stats)
    return {
        "shards": {"total": num_shards, "complete": len(stats), "written_this_run": written},
        "counts": {
            "read": read,
            "kept": kept,
            "rejected": sum(s["rejected"] for s in stats),
            "rejected_by_stage": rejected_by_stage,
        },
        "stages": per_stage,
        "text_only_ranker": audit(written_texts(out)),
        "wall_seconds": round(wall, 3),
        "rows_per_s": round(processed / wall, 2) if processed and wall > 0 else None,  # this run, end to end
        "output": {"ppjd": str(out / "ppjd"), "rejects": str(out / "rejects"), "card": str(out / "README.md")},
        "config": config,
        "config_hash": hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12],
    }


def written_texts(out: Path) -> Iterator[JudgeItem]:
    """Every written PPJD row, this run's and earlier runs', read back without its image: the
    text-only audit must not see it, and a shard's images are most of its bytes."""
    for f in sorted((out / "ppjd").glob("shard-*.parquet")):
        for r in pq.read_table(f, columns=["id", "question", "candidates", "order", "source", "meta"]).to_pylist():
            yield JudgeItem(
                r["id"],
                b"",
                r["question"],
                tuple(r["candidates"]),
                tuple(r["order"]),
                r["source"],
                json.loads(r["meta"]),
            )


def summary(manifest: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    c = manifest["counts"]
    lines = [
        f"read {c['read']}  kept {c['kept']}  rejected {c['rejected']}  "
        f"(shards {manifest['shards']['complete']}/{manifest['shards']['total']}, "
        f"{manifest['shards']['written_this_run']} written now, {manifest['wall_seconds']} s)"
    ]
    for stage, e in manifest["stages"].items():
        rate = e.get("rows_per_s_per_worker")
        lines.append(
            f"  {stage:<9} in {e['in']:>6}  rejected {e['rejected']:>5}" + (f"  {rate} rows/s/worker" if rate else "")
        )
    lines.append(f"  text-only ranker: {text_only_line(manifest['text_only_ranker'])}")
    return "\n".join(lines)
