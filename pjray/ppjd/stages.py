"""The stages of the PPJD job (`pjray.ppjd.pipeline`): what each does to one work row, and the
callables Ray Data maps over pandas batches of them.

A work row (`WORK_COLUMNS`) carries its source fields and, once a stage rejects it,
`reject_stage` / `reject_reason`; later stages pass it along untouched (`each_live_row`), so
the write stage can file it with its reason. Only data problems become rejects (a stage's
returned reason, or a `RowDataError`: a corrupt image, a missing field, an unusable model
reply); any other exception is a bug and fails the job.

- `CpuStages`: load -> verify -> extract -> perturb -> check -> decontam, model-free (scene facts
  or the word lexicon, `pjray.ppjd.rewrites`);
- `LlmStage`: the llm backend's rewrites of the rejected answers on a rollout engine;
- `VlmStage`: the VQA consistency check of each changed fact on a vision-language model.
"""

from __future__ import annotations

import functools
import io
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from pjray.config import PPJDConfig
from pjray.ppjd import llm as llm_prompts
from pjray.ppjd.rejects import RowDataError
from pjray.ppjd.sources import RawRow
from pjray.ppjd.verify import (
    EvalIndex,
    ProbeRecord,
    VlmProber,
    final_check,
    oracle_answer,
    settle,
    span_changes,
    span_probe,
)
from pjray.types import JudgeItem

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
    from pjray.ppjd.lexicon import probe_question
    from pjray.ppjd.rewrites import ranked_rewrites

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
