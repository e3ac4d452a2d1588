"""`pjray ppjd`: the Perceptually Perturbed Judgment Dataset job on Ray Data.

    read (driver) -> shards -> load -> verify -> extract -> perturb -> check -> vqa -> decontam -> write

Every stage is a `map_batches` over pandas batches of work rows (`WORK_COLUMNS`; `build_dataset`).
A row that fails a stage gets `reject_stage` / `reject_reason` and rides along untouched to the
write stage, which splits it into the rejects file: nothing is dropped silently. Only data
problems become rejects (a stage's returned reason, or a `RowDataError`: a corrupt image, a
missing field, an unusable model reply; `each_live_row`); any other exception is a bug and fails
the job, as does a shard in which one stage rejected too many rows (`check_reject_rates`).

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

import functools
import hashlib
import io
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
from pjray.ppjd import llm as llm_prompts
from pjray.ppjd.card import dataset_card, push_to_hub, text_only_line
from pjray.ppjd.rejects import RejectRateError, RowDataError
from pjray.ppjd.shortcuts import audit
from pjray.ppjd.sources import RawRow, read_source
from pjray.ppjd.verify import (
    EvalIndex,
    ProbeRecord,
    VlmProber,
    final_check,
    load_eval_index,
    oracle_answer,
    settle,
    span_changes,
    span_probe,
)
from pjray.types import JudgeItem

log = logging.getLogger(__name__)

STAGES = ("read", "load", "verify", "extract", "perturb", "check", "vqa", "decontam")
WORK_COLUMNS = (
    *RawRow.__dataclass_fields__,  # id, source, question, chosen, answer, image, ... , extra
    "attrs",  # JSON list of perception attributes
    "levels",  # JSON list, best -> worst: {"text", "record": {...}}; level 0 is the chosen answer
    "probes",  # JSON list of ProbeRecord (+ "obj"/"attribute" for structured scene probes)
    "stage_seconds",  # JSON {stage: seconds of work attributed to this row}
    "shard",
    "shard_rows",
)
REJECT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("where", pa.string()),
        ("reject_stage", pa.string()),
        ("reject_reason", pa.string()),
        ("question", pa.string()),
    ]
)
THINK_TAGS = ("<think>", "</think>")
# A stage is judged by its reject fraction only when at least this many rows of a shard reach it.
MIN_ROWS_CHECKED = 10


# --------------------------------------------------------------------------- row plumbing


def _reject(row: dict[str, Any], stage: str, reason: str) -> None:
    row["reject_stage"], row["reject_reason"] = stage, reason


def _timed(stage: str, batch: pd.DataFrame, work: Callable[[list[dict[str, Any]]], None]) -> pd.DataFrame:
    """Run `work` over the batch's rows (in place) and charge its wall time to each row."""
    rows = batch.to_dict("records")
    start = time.perf_counter()
    work(rows)
    share = (time.perf_counter() - start) / max(len(rows), 1)
    for row in rows:
        seconds = json.loads(row["stage_seconds"])
        seconds[stage] = seconds.get(stage, 0.0) + share
        row["stage_seconds"] = json.dumps(seconds)
    return pd.DataFrame(rows, columns=list(WORK_COLUMNS))


def each_live_row(stage: str, fn: Callable[[dict[str, Any]], str | None]) -> Callable[[list[dict[str, Any]]], None]:
    """Apply `fn(row) -> reject reason | None` to rows not yet rejected.

    A `RowDataError` from one row becomes its reject reason: a data job must not die on one bad
    row. Any other exception is a bug in the stage and propagates (the job fails).
    """

    def work(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["reject_stage"]:
                continue
            try:
                problem = fn(row)
            except RowDataError as err:
                problem = str(err)
            if problem:
                _reject(row, stage, problem)

    return work


def _scene_qa(row: dict[str, Any]):
    if not row["scene"]:
        raise LookupError("this row has no scene reference")
    return _qa_of(row["scene"])


@functools.lru_cache(maxsize=4096)
def _qa_of(scene_ref: str):
    """The scene and question of a scene reference; cached because four stages need it (frozen)."""
    from pjray.data.scenes import qa_from_ref

    return qa_from_ref(json.loads(scene_ref))


# --------------------------------------------------------------------------- CPU stages


def load_row(row: dict[str, Any]) -> str | None:
    """Fill `image` with encoded bytes (render, read or keep) and check the row's fields."""
    from PIL import Image

    missing = [k for k in ("question", "chosen") if not row[k]]
    if row["scene"]:
        from pjray.data.scenes import render

        row["image"] = render(_scene_qa(row).scene)
    elif not row["image"] and row["image_path"]:
        path = Path(row["image_path"])
        if not path.is_file():
            return f"image file not found: {path}"
        try:
            row["image"] = path.read_bytes()
        except OSError as err:
            return f"image file unreadable: {path}: {err}"
    if not row["image"]:
        missing.append("image")
    if missing:
        return f"missing field(s): {', '.join(missing)}"
    try:
        with Image.open(io.BytesIO(row["image"])) as img:
            img.load()  # open() is lazy; decode now so a truncated file fails here
    except Exception as err:  # noqa: BLE001  (PIL raises many kinds for bad data)
        return f"corrupt image ({len(row['image'])} bytes): {type(err).__name__}: {err}"
    return None


def chosen_filter(row: dict[str, Any], max_chars: int) -> str | None:
    """The released filters on the chosen answer: no think tags, at most `max_chars` characters."""
    if any(tag in row["chosen"] for tag in THINK_TAGS):
        return "chosen answer contains think tags"
    if len(row["chosen"]) > max_chars:
        return f"chosen answer has {len(row['chosen'])} characters (max {max_chars})"
    return None


def verify_with_truth(row: dict[str, Any]) -> str | None:
    """Chosen must be correct against the ground truth (rows without one go to the LLM)."""
    from pjray.ppjd.perturb import final_answer, normalize_answer

    final = final_answer(row["chosen"])
    if final is None:
        return "chosen answer has no final answer (\\boxed{} or 'Final Answer:')"
    if normalize_answer(final) != normalize_answer(row["answer"]):
        return f"chosen final {final!r} is not the ground truth {row['answer']!r}"
    return None


def extract_rules(row: dict[str, Any]) -> str | None:
    """The facts the rules rewriters can change: a scene's facts, else the lexicon words the answer mentions."""
    if row["scene"]:
        qa = _scene_qa(row)
        row["attrs"] = json.dumps([f"{f.ref}: {f.attribute} {f.value}" for f in qa.facts])
        return None
    from pjray.ppjd.lexicon import mentioned_attributes

    attrs = mentioned_attributes(row["chosen"])
    if not attrs:
        return "the chosen answer mentions no colour, count, relation, size, shape or quoted text"
    row["attrs"] = json.dumps(attrs)
    return None


def perturb_rules(row: dict[str, Any], num_candidates: int, construction: str = "nested") -> str | None:
    """Levels 0..K-1 from a rules rewriter: the scene rewriter for scene rows (levels built by
    `construction`), else the lexicon one. A scene question that cannot carry the construction
    (independent: K - 1 distinct wrong answers) is a reject with the reason."""
    if not row["scene"]:
        return perturb_lexicon(row, num_candidates, construction)
    from pjray.ppjd.perturb import construct_levels, probe_for

    qa = _scene_qa(row)
    # The same stream as `ranked_item`, so the pipeline and the in-process builder agree.
    try:
        levels = construct_levels(qa, num_candidates, random.Random(f"pjray.ppjd.rank:{row['id']}"), construction)
    except ValueError as e:
        if construction == "nested":
            raise  # every kind supports the nested levels (MAX_CANDIDATES): a failure is a bug
        return str(e)
    row["levels"] = json.dumps([{"text": p.text, "record": p.to_json()} for p in levels])
    probes = []
    for level, p in enumerate(levels[1:], start=1):
        for change in p.changes:
            probe = probe_for(qa, change)
            record = ProbeRecord(level, probe.question, change.original, change.perturbed).to_json()
            probes.append({**record, "obj": change.obj, "attribute": change.attribute})
    row["probes"] = json.dumps(probes)
    return None


def perturb_lexicon(row: dict[str, Any], num_candidates: int, construction: str = "nested") -> str | None:
    """Free-text levels 0..K-1 from the lexicon rewriter (levels built by `construction`), with one
    probe per changed fact and level. An answer the rewriter cannot perturb, or that cannot carry
    the construction (independent: K - 1 different wrong finals), is a reject with the reason."""
    from pjray.ppjd.lexicon import probe_question, ranked_rewrites

    try:
        levels = ranked_rewrites(
            row["question"],
            row["chosen"],
            num_candidates,
            random.Random(f"pjray.ppjd.lexicon:{row['id']}"),
            construction,
        )
    except RowDataError as e:
        return str(e)
    row["levels"] = json.dumps([{"text": r.text, "record": r.to_json()} for r in levels])
    probes = [
        {**ProbeRecord(level, probe_question(c), c.original, c.perturbed).to_json(), "class": c.cls}
        for level, r in enumerate(levels[1:], start=1)
        for c in r.changes
    ]
    row["probes"] = json.dumps(probes)
    return None


def set_llm_levels(row: dict[str, Any], rewrites: list[str]) -> str | None:
    """Levels from LLM rewrites, with probes from the attribute words each rewrite changed."""
    levels = [{"text": row["chosen"], "record": {"perception_errors": 0, "reasoning_errors": 0}}]
    probes = []
    for level, text in enumerate(rewrites, start=1):
        changes = span_changes(row["chosen"], text)
        if not changes:
            return f"level {level}: the rewrite changes no attribute words (a probe needs a short edit)"
        kind = "perception" if level == 1 else "perception+reasoning"
        levels.append({"text": text, "record": {"kind": kind, "changes": [list(c) for c in changes]}})
        probes.extend(span_probe(level, o, p).to_json() for o, p in changes)
    row["levels"], row["probes"] = json.dumps(levels), json.dumps(probes)
    return None


def check_finals(row: dict[str, Any]) -> str | None:
    from pjray.ppjd.perturb import final_answer

    truth = row["answer"] or final_answer(row["chosen"]) or ""
    problems = final_check([lv["text"] for lv in json.loads(row["levels"])], truth)
    return "; ".join(problems) or None


def vqa_oracle(row: dict[str, Any]) -> str | None:
    """Probes answered from the scene's facts (regenerated from the seed, not from the rewrite)."""
    if not row["scene"]:
        return "the oracle answers from scene facts; this row has none (use ppjd.vqa_backend=vlm)"
    from pjray.data.scenes import scene_from_ref

    ref = json.loads(row["scene"])
    # Regenerated from the seed (not taken from the rewrite's records) so the check is independent.
    scene = scene_from_ref(ref)
    answers = []
    for p in json.loads(row["probes"]):
        truth = {"value": getattr(scene.objects[p["obj"]], p["attribute"])} if "attribute" in p else None
        answers.append(oracle_answer(ref, _probe(p), truth))
    return settle_probes(row, answers)


def _probe(p: dict[str, Any]) -> ProbeRecord:
    return ProbeRecord(p["level"], p["question"], p["original"], p["perturbed"])


def settle_probes(row: dict[str, Any], answers: list[str]) -> str | None:
    """Record each probe's answer; reject unless every level has probes and all are consistent."""
    probes = json.loads(row["probes"])
    settled = []
    for p, answer in zip(probes, answers, strict=True):
        s = settle(_probe(p), answer)
        settled.append({**p, "answer": s.answer, "consistent": s.consistent})
    row["probes"] = json.dumps(settled)
    levels = range(1, len(json.loads(row["levels"])))
    bare = [lv for lv in levels if not any(p["level"] == lv for p in settled)]
    if bare:
        return f"level(s) {bare} have no probe"
    bad = [p for p in settled if not p["consistent"]]
    if bad:
        p = bad[0]
        return (
            f"level {p['level']} probe {p['question']!r} answered {p['answer']!r}: "
            f"not the original {p['original']!r} alone (perturbed {p['perturbed']!r})"
        )
    return None


def decontam_row(row: dict[str, Any], index: EvalIndex, max_distance: int) -> str | None:
    return index.match(row["image"], row["question"], max_distance)


def to_item(row: dict[str, Any], num_candidates: int) -> JudgeItem:
    """The PPJD row of a kept work row; candidates shuffled by a seed of the id."""
    levels = json.loads(row["levels"])
    if len(levels) != num_candidates:
        raise ValueError(f"{len(levels)} levels, expected {num_candidates}")
    slots = list(range(num_candidates))
    random.Random(f"pjray.ppjd.order:{row['id']}").shuffle(slots)  # level l -> candidates[slots[l]]
    candidates = [""] * num_candidates
    for level, slot in zip(levels, slots):
        candidates[slot] = level["text"]
    meta = {
        "truth": row["answer"],
        "attrs": json.loads(row["attrs"]),
        "levels": [{"candidate": slot, **level["record"]} for level, slot in zip(levels, slots)],
        "probes": json.loads(row["probes"]),
    }
    if row["scene"]:
        meta["scene"] = json.loads(row["scene"])
    return JudgeItem(row["id"], row["image"], row["question"], tuple(candidates), tuple(slots), row["source"], meta)


# --------------------------------------------------------------------------- stage callables


class CpuStages:
    """The model-free stages, each a pandas batch -> batch function (run as Ray tasks)."""

    def __init__(self, cfg: PPJDConfig, eval_index: EvalIndex) -> None:
        self.cfg, self.eval_index = cfg, eval_index

    def load(self, batch: pd.DataFrame) -> pd.DataFrame:
        return _timed("load", batch, each_live_row("load", load_row))

    def verify(self, batch: pd.DataFrame) -> pd.DataFrame:
        def fn(row: dict[str, Any]) -> str | None:
            problem = chosen_filter(row, self.cfg.max_chosen_chars)
            if problem or not row["answer"]:
                return problem or "no ground truth to verify against (needs ppjd.perturb_backend=llm)"
            return verify_with_truth(row)

        return _timed("verify", batch, each_live_row("verify", fn))

    def extract(self, batch: pd.DataFrame) -> pd.DataFrame:
        return _timed("extract", batch, each_live_row("extract", extract_rules))

    def perturb(self, batch: pd.DataFrame) -> pd.DataFrame:
        return _timed(
            "perturb",
            batch,
            each_live_row("perturb", lambda r: perturb_rules(r, self.cfg.num_candidates, self.cfg.construction)),
        )

    def check(self, batch: pd.DataFrame) -> pd.DataFrame:
        return _timed("check", batch, each_live_row("check", check_finals))

    def vqa(self, batch: pd.DataFrame) -> pd.DataFrame:
        return _timed("vqa", batch, each_live_row("vqa", vqa_oracle))

    def decontam(self, batch: pd.DataFrame) -> pd.DataFrame:
        max_distance = self.cfg.phash_max_distance
        return _timed(
            "decontam", batch, each_live_row("decontam", lambda r: decontam_row(r, self.eval_index, max_distance))
        )


class LlmStage:
    """verify -> extract -> perturb with a text LLM (the released three prompt roles), one actor.

    Each role is one batched `chat` call over the rows still alive; a reply that fails strict
    parsing rejects its row at that role's stage with the parser's reason.
    """

    def __init__(self, cfg: PPJDConfig, engine: llm_prompts.TextEngine | None = None) -> None:
        self.cfg = cfg
        if engine is not None:  # an engine built elsewhere (tests hand in canned replies)
            self.engine = engine
            return
        import torch

        device = "cuda" if cfg.num_gpus_per_actor > 0 and torch.cuda.is_available() else "cpu"
        self.engine = llm_prompts.build_text_engine(
            llm_prompts.TextEngineSpec(
                model=cfg.llm_model,
                gguf_file=cfg.llm_gguf_file,
                engine=cfg.llm_engine,
                max_new_tokens=cfg.llm_max_new_tokens,
                temperature=cfg.llm_temperature,
                device=device,
            )
        )

    def _role(
        self,
        stage: str,
        rows: list[dict[str, Any]],
        wanted: Callable[[dict[str, Any]], bool],
        messages: Callable[[dict[str, Any]], list],
        apply: Callable[[dict[str, Any], str], str | None],
    ) -> None:
        live = [r for r in rows if not r["reject_stage"] and wanted(r)]
        replies = self.engine.chat([messages(r) for r in live]) if live else []
        for row, reply in zip(live, replies):
            try:
                problem = apply(row, reply)
            except llm_prompts.LLMReplyError as err:
                problem = f"unusable LLM reply: {err}"
            if problem:
                _reject(row, stage, problem)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        cfg = self.cfg
        batch = _timed(
            "verify",
            batch,
            each_live_row(
                "verify",
                lambda r: chosen_filter(r, cfg.max_chosen_chars) or (verify_with_truth(r) if r["answer"] else None),
            ),
        )
        batch = _timed(
            "verify",
            batch,
            lambda rows: self._role(
                "verify",
                rows,
                lambda r: not r["answer"],
                lambda r: llm_prompts.verify_messages(r["question"], r["chosen"], r["answer"]),
                lambda r, reply: (
                    None if llm_prompts.parse_verify(reply) else "the LLM judged the chosen answer incorrect"
                ),
            ),
        )

        def set_attrs(row: dict[str, Any], reply: str) -> None:
            row["attrs"] = json.dumps(llm_prompts.parse_extract(reply))

        batch = _timed(
            "extract",
            batch,
            lambda rows: self._role(
                "extract",
                rows,
                lambda r: True,
                lambda r: llm_prompts.extract_messages(r["question"], r["chosen"]),
                set_attrs,
            ),
        )

        def set_rewrites(row: dict[str, Any], reply: str) -> str | None:
            first, second = llm_prompts.parse_rewrite(reply, row["chosen"])
            return set_llm_levels(row, [first, second][: cfg.num_candidates - 1])

        return _timed(
            "perturb",
            batch,
            lambda rows: self._role(
                "perturb",
                rows,
                lambda r: True,
                lambda r: llm_prompts.rewrite_messages(r["question"], r["chosen"], json.loads(r["attrs"])),
                set_rewrites,
            ),
        )


class VlmStage:
    """The VQA consistency filter with a VLM judge answering each probe from the image."""

    def __init__(self, cfg: PPJDConfig) -> None:
        import torch

        from pjray.config import ModelConfig, RolloutConfig
        from pjray.rollout.hf_engine import HFEngine

        device = "cuda" if cfg.num_gpus_per_actor > 0 and torch.cuda.is_available() else "cpu"
        # Near-greedy: the engine always samples (it serves GRPO); a tiny temperature picks the mode.
        rollout = RolloutConfig(max_new_tokens=cfg.vlm_max_new_tokens, temperature=1e-3, top_k=1)
        engine = HFEngine(cfg.vlm_model, ModelConfig(path=cfg.vlm_model, think_prefix=False), rollout, device=device)
        self.prober = VlmProber(engine)
        self.seed = cfg.seed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        def work(rows: list[dict[str, Any]]) -> None:
            live = [r for r in rows if not r["reject_stage"]]
            asks = [(r["image"], p["question"]) for r in live for p in json.loads(r["probes"])]
            answers = iter(self.prober.answer(asks, self.seed))
            for row in live:
                n = len(json.loads(row["probes"]))
                problem = settle_probes(row, [next(answers) for _ in range(n)])
                if problem:
                    _reject(row, "vqa", problem)

        return _timed("vqa", batch, work)


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
