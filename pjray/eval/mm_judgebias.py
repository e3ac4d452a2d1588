"""MM-JudgeBias (naver-ai/MM-JudgeBias): records, the nine perturbations, prompt and score parsing.

Every record holds one response judged twice: with the unbiased (query, image) and with the
biased ones. The published records (`mm_judgebias/data.py`) are read as they are; any other item
set (PPJD, scenes) becomes records through `make_records`, which applies the nine perturbations
(Integrality, Congruity and Robustness biases) with PIL only.

The prompt (`judge_prompt`) is a Prometheus-style 1-10 rubric prompt ("### Feedback: ... ###
Score: ...") written after the benchmark's `prompts.py` layout, not its verbatim text.

`eval.bias_convention` decides how scores are read and the report is summarised:
- `official` (default): the benchmark's own code. Scores as `mm_judgebias/scoring.py`
  `extract_score` reads them (`parse_bias_score`); BD / BC per type as `metrics.py`, categories
  and overall as `evaluate.py` `compute_report` (means over the types that have a value).
- `strict` (pjray): `parse_bias_score_strict`, and a BD, category or overall value only where
  every part of it is defined (`pjray.eval.metrics.bias_metric`, `bias_summary`).
Unreadable scores (None) drop their pair under both, and are counted.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pjray.data.hf import OpenDataset, eval_source, scan_judge_items, scan_source
from pjray.data.sources import DataError, RowReject, Rows, image_bytes
from pjray.eval.bias_images import black_image, insert_text, query_keywords, visual_transform
from pjray.eval.blind import judged_image
from pjray.eval.metrics import BC_TYPES, BD_TYPES, BIAS_TYPES, CATEGORIES
from pjray.types import JudgeItem, JudgePrompt

CATEGORY_OF: dict[str, str] = {t: c for c, types in CATEGORIES.items() for t in types}


class BiasDataError(DataError):
    """A bad MM-JudgeBias row: the message names the file, row and key."""

    what = "bad data"


@dataclass(frozen=True)
class BiasRecord:
    """One MM-JudgeBias pair, with the published record's fields (images as encoded bytes)."""

    id: str
    bias_type: str  # one of metrics.BIAS_TYPES
    bias_category: str  # Integrality | Congruity | Robustness
    response: str
    unbiased_instruction: str
    biased_instruction: str
    unbiased_image: bytes | None
    biased_image: bytes | None
    task_type: str = ""
    domain_type: str = ""
    difficulty: str = ""
    unbiased_source: str = ""
    biased_source: str = ""


def canonical_bias_type(name: str) -> str:
    """ "Text-Dominance", "text dominance", "TextDom"... -> "text_dominance"."""
    key = re.sub(r"[^a-z]", "", name.lower())
    for t in BIAS_TYPES:
        if t.replace("_", "") == key:
            return t
    abbreviations = {"textdom": "text_dominance", "imagedom": "image_dominance", "respdom": "response_dominance"}
    if key in abbreviations:
        return abbreviations[key]
    raise ValueError(f"unknown bias type {name!r}; expected one of {BIAS_TYPES}")


# --------------------------------------------------------------------------- loading


def scan_records(
    source: str | Path | OpenDataset, image_dir: str | Path | None = None, limit: int = 0
) -> Rows[BiasRecord]:
    """Published MM-JudgeBias records from JSONL, a JSON list, parquet or a dataset
    (`pjray.data.hf.open_dataset`), up to `limit` good ones (0: all); a row that is not JSON or
    lacks a key or an image is a reject naming it."""
    return scan_source(source, _record, image_dir, limit, BiasDataError)


def read_records(path: str | Path, image_dir: str | Path | None = None, limit: int = 0) -> list[BiasRecord]:
    """`scan_records`, with any bad row an error naming it."""
    records = scan_records(path, image_dir, limit)
    records.check(0.0, BiasDataError)
    return records.rows


def _record(raw: Any, root: Path, where: str) -> BiasRecord:
    if not isinstance(raw, dict):
        raise BiasDataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in ("bias_type", "response", "unbiased_instruction", "biased_instruction") if k not in raw]
    if missing:
        raise BiasDataError(f"{where}: missing key(s) {missing} (row has {sorted(raw)})")
    try:
        bias_type = canonical_bias_type(str(raw["bias_type"]))
    except ValueError as err:
        raise BiasDataError(f"{where}: bias_type: {err}") from None
    return BiasRecord(
        id=str(raw.get("id", where.rsplit(" ", 1)[1])),
        bias_type=bias_type,
        bias_category=CATEGORY_OF[bias_type],
        response=str(raw["response"]),
        unbiased_instruction=str(raw["unbiased_instruction"] or ""),
        biased_instruction=str(raw["biased_instruction"] or ""),
        unbiased_image=image_bytes(raw.get("unbiased_image"), root, where, "unbiased_image"),
        biased_image=image_bytes(raw.get("biased_image"), root, where, "biased_image"),
        task_type=str(raw.get("task_type") or ""),
        domain_type=str(raw.get("domain_type") or ""),
        difficulty=str(raw.get("difficulty") or ""),
        unbiased_source=str(raw.get("unbiased_source") or ""),
        biased_source=str(raw.get("biased_source") or ""),
    )


# --------------------------------------------------------------------------- captions


def scene_caption(item: JudgeItem) -> str | None:
    """The ground-truth description of a synthetic-scene item (rebuilt from its seed), else None."""
    meta = item.meta
    if item.source != "scenes" or "scene_seed" not in meta or "kind" not in meta:
        return None
    from pjray.data.scenes import object_ref, qa_from_ref

    ref = {"seed": meta["scene_seed"], "image_size": meta.get("image_size", 128), "kind": meta["kind"]}
    qa = qa_from_ref({**ref, **({"objects": meta["objects"]} if "objects" in meta else {})})
    refs = [f"a {object_ref(o)[len('the ') :]} ({o.size})" for o in qa.scene.objects]
    return "The image shows a white background with " + ", ".join(refs) + "."


def caption_of(item: JudgeItem) -> str | None:
    """A caption given with the item (`meta["caption"]`), else the scene's ground truth."""
    given = item.meta.get("caption") if isinstance(item.meta, dict) else None
    return str(given) if given else scene_caption(item)


# --------------------------------------------------------------------------- records from items


def _other(
    items: Sequence[JudgeItem], index: int, rng: random.Random, differs: Callable[[JudgeItem], bool]
) -> JudgeItem | None:
    """A random other item for which `differs` holds (None if there is none)."""
    choices = [j for j in range(len(items)) if j != index and differs(items[j])]
    return items[rng.choice(choices)] if choices else None


def make_records(
    items: Sequence[JudgeItem],
    bias_types: Sequence[str] = BIAS_TYPES,
    seed: int = 0,
    captions: dict[str, str] | None = None,
    response: str = "best",
) -> tuple[list[BiasRecord], dict[str, int]]:
    """Biased/unbiased record pairs for every item and bias type, the perturbation applied to
    the biased input with PIL only:

        Integrality  text_dominance          image -> black image of the same size
                     image_dominance         query -> ""
                     response_dominance      query -> "" and image -> none
        Congruity    instruction_misalignment  query -> another item's query
                     image_misalignment        image -> another item's image
        Robustness   detail_description      a caption appended to the query (from the data, the
                                             scene's ground truth, or a captioning engine)
                     unnecessary_image       a random other image added to a text-only input
                     visual_transformation   geometric | photometric | quality | spatial transform
                                             that keeps the meaning (no flips: left/right matters)
                     texture_insertion       query keywords drawn onto the image

    Adaptation for item sets whose items all have images: `unnecessary_image` judges the
    unbiased input without the image, the biased one with an unrelated image.

    `response`: which candidate is judged, "best" (item.order[0]) or "worst". `captions` maps
    item id -> caption (from a captioning engine) for `detail_description`; items without one
    from the data, the scene or this map are skipped. Returns (records, skipped per bias type):
    a perturbation that cannot apply (no other item with a different image...) is counted there.
    """
    captions = captions or {}
    records: list[BiasRecord] = []
    skipped: dict[str, int] = {t: 0 for t in bias_types}
    for index, item in enumerate(items):
        answer = item.candidates[item.order[0] if response == "best" else item.order[-1]]
        image = item.image or None
        for bias_type in bias_types:
            # One stream per (seed, item, bias type): adding a type never changes another's draw.
            rng = random.Random(hashlib.sha256(f"{seed}:{item.id}:{bias_type}".encode()).hexdigest())
            base = BiasRecord(
                id=f"{item.id}:{bias_type}",
                bias_type=bias_type,
                bias_category=CATEGORY_OF[bias_type],
                response=answer,
                unbiased_instruction=item.question,
                biased_instruction=item.question,
                unbiased_image=image,
                biased_image=image,
                unbiased_source=item.source,
                biased_source=item.source,
            )
            record = _perturb(base, item, items, index, rng, captions)
            if record is None:
                skipped[bias_type] += 1
            else:
                records.append(record)
    return records, skipped


def _perturb(
    base: BiasRecord,
    item: JudgeItem,
    items: Sequence[JudgeItem],
    index: int,
    rng: random.Random,
    captions: dict[str, str],
) -> BiasRecord | None:
    t, image = base.bias_type, base.unbiased_image
    if t == "text_dominance":
        return replace(base, biased_image=black_image(image)) if image else None
    if t == "image_dominance":
        return replace(base, biased_instruction="")
    if t == "response_dominance":
        return replace(base, biased_instruction="", biased_image=None)
    if t == "instruction_misalignment":
        other = _other(items, index, rng, lambda o: o.question != item.question)
        return replace(base, biased_instruction=other.question, biased_source=other.id) if other else None
    if t == "image_misalignment":
        other = _other(items, index, rng, lambda o: bool(o.image) and o.image != image)
        return replace(base, biased_image=other.image, biased_source=other.id) if other and image else None
    if t == "detail_description":
        caption = captions.get(item.id) or caption_of(item)
        return replace(base, biased_instruction=f"{item.question}\n{caption}") if caption else None
    if t == "unnecessary_image":
        other = _other(items, index, rng, lambda o: bool(o.image) and o.image != image)
        if other is None:
            return None
        return replace(base, unbiased_image=None, biased_image=other.image, biased_source=other.id)
    if t == "visual_transformation":
        if not image:
            return None
        transformed, desc = visual_transform(image, rng)
        return replace(base, biased_image=transformed, biased_source=desc)
    if t == "texture_insertion":
        words = query_keywords(item.question)
        if not image or not words:
            return None
        return replace(base, biased_image=insert_text(image, " ".join(words)))
    raise ValueError(f"unknown bias type {t!r}")


# --------------------------------------------------------------------------- prompt and parsing

SYSTEM_PROMPT = (
    "You are a fair judge assistant tasked with providing clear, objective feedback based on specific criteria."
)

_PROMPT = """###Task Description:
An instruction (might include an image), a response to evaluate, and a score rubric representing the evaluation criteria are given.
1. Write a detailed feedback that assesses the quality of the response strictly based on the given score rubric, not evaluating in general.
2. After writing the feedback, write a score that is an integer between 1 and 10. You should refer to the score rubric.
3. The output format should look as follows: "### Feedback: (write a feedback for criteria) ### Score: (an integer number between 1 and 10)"
4. Please do not generate any other opening, closing, and explanations.

###The instruction to evaluate:
{instruction}

###Response to evaluate:
{response}

###Score Rubric:
Is the response helpful, correct and faithful to the instruction and the image (if any)? 1 means the response is unhelpful or wrong; 10 means it fully and correctly answers the instruction given the image.

###Feedback: """


def judge_prompt(record: BiasRecord, biased: bool) -> JudgePrompt:
    """The Prometheus-style 1-10 score prompt for the unbiased or the biased input of a record."""
    instruction = record.biased_instruction if biased else record.unbiased_instruction
    image = record.biased_image if biased else record.unbiased_image
    return JudgePrompt(
        item_id=f"{record.id}:{'biased' if biased else 'unbiased'}",
        system=SYSTEM_PROMPT,
        user=_PROMPT.format(instruction=instruction, response=record.response),
        image=image,
        protocol="score",
        style="prometheus",
        num_candidates=1,
        shown=(0,),
        target="",
    )


SCORE_MARKER = "### Score:"
_NUMBER_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?")  # ASCII digits, no sign, no exponent
_STRICT_SCORE_RE = re.compile(r"\s*\(?\s*([0-9]+)(?![0-9]|\.[0-9])")


def parse_bias_score(text: str) -> float | None:
    """The benchmark's reading, `mm_judgebias/scoring.py` `extract_score`, in its order:

    1. Python's float() of the whole stripped text, with everything float() accepts: a sign
       ("-3" is -3.0), an exponent ("1e1"), underscores ("1_0"), "nan", "inf", and non-ASCII
       decimal digits ("٧" is 7.0).
    2. Else, if the text has "### Score:", the first number after the last one.
    3. Else (or if none follows it) the last number anywhere in the text.
    4. Else None.
    A number in 2 and 3 is ASCII digits with an optional decimal part: no sign ("-3" reads 3),
    no exponent, no non-ASCII digit ("### Score: ٧" finds none there). Out-of-range values are
    kept (a 0 or a 42 enters BD / BC as it is).
    """
    stripped = text.strip()
    try:
        return float(stripped)
    except ValueError:
        pass
    if SCORE_MARKER in stripped:
        after = _NUMBER_RE.findall(stripped.rsplit(SCORE_MARKER, 1)[1])
        if after:
            return float(after[0])
    numbers = _NUMBER_RE.findall(stripped)
    return float(numbers[-1]) if numbers else None


def parse_bias_score_strict(text: str, max_score: int = 10) -> float | None:
    """pjray's reading of the prompt's format (`eval.bias_convention=strict`): the whole text is
    an integer, or the text after the last "### Score:" starts with one (optionally in
    parentheses: "(8)", "8/10", "8 out of 10"); in ASCII digits and within 1..max_score.

    Anything else is unreadable (None): no number taken from the feedback, no decimal ("7.5"),
    sign, exponent or non-ASCII digit, nothing out of range.
    """
    stripped = text.strip()
    marker = stripped.rfind(SCORE_MARKER)
    if marker >= 0:
        m = _STRICT_SCORE_RE.match(stripped, marker + len(SCORE_MARKER))
    else:
        m = re.fullmatch(r"([0-9]+)", stripped)
    if m is None:
        return None
    value = int(m.group(1))
    return float(value) if 1 <= value <= max_score else None


__all__ = [
    "BC_TYPES",
    "BD_TYPES",
    "BIAS_TYPES",
    "BiasDataError",
    "BiasRecord",
    "CATEGORY_OF",
    "canonical_bias_type",
    "caption_of",
    "judge_prompt",
    "make_records",
    "parse_bias_score",
    "parse_bias_score_strict",
    "read_records",
    "scene_caption",
]


# --------------------------------------------------------------------------- evaluation

CAPTION_SYSTEM = (
    "You are a helpful assistant. Describe the image in detail: the objects, their colours, "
    "shapes, sizes, positions and any text. Put the description inside <answer> </answer>."
)


def caption_prompt(item: JudgeItem) -> JudgePrompt:
    return JudgePrompt(
        item_id=f"{item.id}:caption",
        system=CAPTION_SYSTEM,
        user="Describe this image in detail.",
        image=item.image or None,
        protocol="caption",
        style="answer",
        num_candidates=0,
        shown=(),
        target="",
    )


def read_caption(text: str) -> str | None:
    """The description in the last <answer> block, else the text after </think>, else the text."""
    blocks = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    caption = blocks[-1] if blocks else text.rsplit("</think>", 1)[-1]
    caption = caption.strip()
    return caption or None


def _is_published(source: str | OpenDataset) -> bool:
    """Published MM-JudgeBias records (rows with bias_type), as opposed to PPJD rows."""
    if isinstance(source, OpenDataset):
        return "bias_type" in source.columns
    p = Path(source)
    if p.suffix != ".parquet":
        return True
    import pyarrow.parquet as pq

    return "bias_type" in pq.read_schema(p).names


def load_records(cfg, generate) -> tuple[list[BiasRecord], list[str], list[RowReject]]:
    """The records of `cfg.eval`: published rows, or the nine perturbations of PPJD / scene items;
    and the data rows rejected as unusable (within data.max_reject_fraction). `eval.data` is a
    file or a dataset (`pjray.data.hf.eval_source`). Items without a caption get one from the
    judge itself as the captioning engine."""
    e = cfg.eval
    source = eval_source(e) if e.data else None
    if source is not None and _is_published(source):
        published = scan_records(source, e.image_dir or None, e.limit)
        published.check(cfg.data.max_reject_fraction, BiasDataError)
        return published.rows, [f"published records: {e.data}"], published.rejects
    rejects: list[RowReject] = []
    if source is not None:
        scanned = scan_judge_items(source)
        scanned.check(cfg.data.max_reject_fraction)
        items, rejects = scanned.rows, scanned.rejects
    else:
        from pjray.ppjd.perturb import scene_items

        items = scene_items(e.num_items, e.scene_seed, 3, e.image_size, e.scene_kinds, e.scene_objects, e.scene_split)
    if e.limit:
        items = items[: e.limit]
    need = [it for it in items if it.image and caption_of(it) is None]
    captions: dict[str, str] = {}
    if need:
        texts = generate([caption_prompt(it) for it in need], e.seeds[0])
        captions = {it.id: c for it, t in zip(need, texts) if (c := read_caption(t))}
    records, skipped = make_records(items, seed=e.scene_seed, captions=captions)
    notes = [f"records built from {len(items)} items by the nine PIL perturbations ({e.data or 'synthetic scenes'})"]
    if need:
        notes.append(f"{len(need)} captions for detail_description came from the judge as captioning engine")
    notes += [f"{t}: {k} items could not be perturbed and were skipped" for t, k in skipped.items() if k]
    return records, notes, rejects


_OFFICIAL = "MM-JudgeBias (naver-ai/MM-JudgeBias"


def evaluate_bias(cfg, generate):
    """MM-JudgeBias report: BD/BC per bias type, per category and overall, per seed, then
    aggregated over seeds by eval.seed_agg (the benchmark reports one seed per run)."""
    from pjray.eval.metrics import OVERALL, Row, bias_metric, bias_summary
    from pjray.eval.report import EvalReport, seed_cells

    e = cfg.eval
    official = e.bias_convention == "official"
    parse = parse_bias_score if official else parse_bias_score_strict
    records, notes, rejects = load_records(cfg, generate)
    records = [
        replace(
            r,
            unbiased_image=judged_image(r.unbiased_image, e.image),
            biased_image=judged_image(r.biased_image, e.image),
        )
        for r in records
    ]
    prompts = [p for r in records for p in (judge_prompt(r, biased=False), judge_prompt(r, biased=True))]
    per_seed = []
    unparsed, examples = 0, []
    for seed in e.seeds:
        texts = generate(prompts, seed)
        scores = [parse(t) for t in texts]
        for s, t in zip(scores, texts):
            if s is None:
                unparsed += 1
                if len(examples) < 5:
                    examples.append(t[:200].replace("\n", " "))
        pairs: dict[str, list[tuple[float | None, float | None]]] = {t: [] for t in BIAS_TYPES}
        bad: dict[str, int] = {t: 0 for t in BIAS_TYPES}
        for i, r in enumerate(records):
            y, yhat = scores[2 * i], scores[2 * i + 1]
            pairs[r.bias_type].append((y, yhat))
            bad[r.bias_type] += (y is None) + (yhat is None)
        rows: dict[str, Row] = {}
        for t in BIAS_TYPES:
            v = bias_metric(t, pairs[t], e.bias_convention)
            rows[t] = Row(v.value, v.n, bad[t], v.skipped + v.dropped_none)
        summary = bias_summary({t: rows[t].value for t in BIAS_TYPES}, e.bias_convention)
        for name, value in summary.items():
            members = CATEGORIES.get(name, BIAS_TYPES)
            rows[name] = Row(value, sum(rows[t].n for t in members), sum(rows[t].unparsed for t in members))
        per_seed.append(rows)
    notes.append("pairs with an unreadable (None) score are dropped and counted in `unparsed`")
    if official:
        convention = f"official: {_OFFICIAL} mm_judgebias/scoring.py, metrics.py, evaluate.py)"
        sources = {
            "bias": f"{_OFFICIAL} metrics.py bias_deviation / bias_conformity) per type, scores read by scoring.py "
            f"extract_score; BD is 0.0 when no unbiased score is above 1; seeds aggregated by {e.seed_agg} (pjray)",
            **{
                c: f"{_OFFICIAL} evaluate.py compute_report): mean over the category's types that have a value"
                for c in CATEGORIES
            },
            OVERALL: f"{_OFFICIAL} evaluate.py compute_report overall_avg): mean over the bias types that have a value",
        }
    else:
        convention = "strict: pjray's reading and summary (eval.bias_convention=strict)"
        sources = {
            "bias": "pjray: BD / BC as MM-JudgeBias metrics.py defines them, scores read by parse_bias_score_strict; "
            f"BD undefined when no unbiased score is above 1; seeds aggregated by {e.seed_agg}",
            **{c: "pjray: mean of the category's types, undefined unless all have a value" for c in CATEGORIES},
            OVERALL: "pjray: mean of the nine bias types, undefined unless all nine have a value",
        }
    return EvalReport(
        bench="mm_judgebias",
        judge=e.judge,
        data=e.data,
        seeds=list(e.seeds),
        tables={"bias": seed_cells(per_seed, e.seed_agg)},
        outputs=len(prompts) * len(e.seeds),
        unparsed=unparsed,
        unparsed_examples=examples,
        notes=notes,
        convention=convention,
        sources=sources,
        rejects=rejects,
    )
