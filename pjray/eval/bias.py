"""The perceptual-judgment-bias diagnosis: Mode (a) insufficient perception vs Mode (b)
response-anchored judgment (the paper's Table 1).

For each item the judge
1. scores the correct answer and a perceptually wrong answer (same question and image, only
   perception facts changed) with the score protocol (`render_score`, 1-10);
2. answers the probe question(s) about the changed fact(s) as a plain VQA prompt
   (`render_probe`).

A perceptual judgment error is score(wrong) >= score(correct). An error with a wrong probe
answer is Mode (a) (the judge does not see the fact); with a right one, Mode (b) (it sees the
fact but believes the answer). Rates are over items whose two scores were readable
(`metrics.mode_rates`); unreadable outputs are counted, never dropped silently.

Items: any `JudgeItem` whose `meta["levels"]` carries the scene/PPJD perturbation records
(`pjray.ppjd.perturb.ranked_item`): level 0 is the correct answer, the first level with
perception errors and no reasoning error is the perceptually wrong one, and its `probes` hold
the questions with their true answers.

Probe answers are read from the last `<answer>` block (else from the text after `</think>`,
when that is at most a few words), normalised with `pjray.ppjd.perturb.normalize_answer`, and
right when equal to the normalised truth, or when a short reply (<= 6 words, no negation) ends
with it ("it is red"). With several probes the judge perceives the item only if all are right.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pjray.data.prompts import render_probe, render_score
from pjray.data.sources import RowReject
from pjray.errors import InputError
from pjray.eval.blind import judged_image
from pjray.eval.metrics import ModeRates, ModeRecord, mode_rates
from pjray.ppjd.perturb import normalize_answer
from pjray.reward.parse import parse_score
from pjray.types import JudgeItem, JudgePrompt

# generate(prompts, seed) -> one response text per prompt, in order.
Generate = Callable[[list[JudgePrompt], int], list[str]]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NEGATIONS = {"not", "no", "isn't", "never", "neither", "nor"}


class DiagnosisDataError(InputError):
    """An item without the perturbation metadata the diagnosis needs; names the item."""

    what = "bad data"


@dataclass(frozen=True)
class DiagnosisItem:
    id: str
    image: bytes | None  # None: judged without its image (eval.image=none)
    question: str
    correct: str
    wrong: str  # perception errors only, reasoning intact
    probes: tuple[tuple[str, str], ...]  # (question, true answer) per changed fact
    kind: str  # the question kind (scenes) or "" when unknown


def diagnosis_item(item: JudgeItem) -> DiagnosisItem:
    """The correct / perceptually wrong answers and probes of one item (see the module doc)."""
    levels = item.meta.get("levels") if isinstance(item.meta, dict) else None
    if not levels:
        raise DiagnosisDataError(f"item {item.id!r}: no meta['levels'] (perturbation records with probes)")
    wrong = next(
        (lv for lv in levels[1:] if lv.get("perception_errors", 0) > 0 and lv.get("reasoning_errors", 0) == 0),
        None,
    )
    if wrong is None or not wrong.get("probes"):
        raise DiagnosisDataError(f"item {item.id!r}: no perception-only level with probes in meta['levels']")
    try:
        probes = tuple((str(p["question"]), str(p["answer"])) for p in wrong["probes"])
        correct, perturbed = item.candidates[levels[0]["candidate"]], item.candidates[wrong["candidate"]]
    except (KeyError, IndexError, TypeError) as err:
        raise DiagnosisDataError(f"item {item.id!r}: malformed meta['levels'] ({err!r})") from None
    return DiagnosisItem(item.id, item.image, item.question, correct, perturbed, probes, str(item.meta.get("kind", "")))


def item_prompts(d: DiagnosisItem) -> list[JudgePrompt]:
    """[score(correct), score(wrong), probe_1, ..., probe_m]."""
    return [
        render_score(d.question, d.image, d.correct, item_id=f"{d.id}:correct"),
        render_score(d.question, d.image, d.wrong, item_id=f"{d.id}:wrong"),
        *[render_probe(q, d.image, item_id=f"{d.id}:probe{i}") for i, (q, _) in enumerate(d.probes)],
    ]


def read_probe_answer(text: str) -> str | None:
    """The judge's probe answer: the last <answer> block, else a short text after </think>."""
    blocks = _ANSWER_RE.findall(text)
    if blocks:
        answer = blocks[-1].strip()
        return answer or None
    if "</think>" in text:
        tail = text.rsplit("</think>", 1)[1].strip()
        if tail and len(tail.split()) <= 6:
            return tail
    return None


def probe_correct(pred: str, truth: str) -> bool:
    """Normalised equality, or a short negation-free reply that ends with the truth."""
    p, t = normalize_answer(pred).split(), normalize_answer(truth).split()
    if not t:
        return False
    if p == t:
        return True
    return len(p) <= 6 and p[-len(t) :] == t and not (_NEGATIONS & set(p))


def read_judge_score(text: str) -> float | None:
    """The score-protocol verdict 1-10, or None (badly formatted but readable counts, so the
    think layout, and whether the prompt opened `<think>`, does not matter)."""
    j = parse_score(text)
    return float(j.scores[0]) if j.scores and 1 <= j.scores[0] <= 10 else None


def mode_record(d: DiagnosisItem, texts: Sequence[str]) -> ModeRecord:
    """The diagnosis record of one item from its responses, in `item_prompts` order."""
    correct = read_judge_score(texts[0])
    wrong = read_judge_score(texts[1])
    answers = [read_probe_answer(t) for t in texts[2:]]
    if any(a is None for a in answers):
        probe_ok = None
    else:
        probe_ok = all(probe_correct(a, truth) for a, (_, truth) in zip(answers, d.probes))  # type: ignore[arg-type]
    return ModeRecord(correct, wrong, probe_ok)


def diagnose(
    generate: Generate, items: Sequence[DiagnosisItem], seed: int
) -> tuple[ModeRates, list[ModeRecord], list[str]]:
    """Judge every item once under `seed`; returns (rates, records, all response texts)."""
    prompts: list[JudgePrompt] = []
    spans = []
    for d in items:
        p = item_prompts(d)
        spans.append((len(prompts), len(prompts) + len(p)))
        prompts.extend(p)
    texts = generate(prompts, seed)
    records = [mode_record(d, texts[a:b]) for d, (a, b) in zip(items, spans)]
    return mode_rates(records), records, texts


def rates_metrics(rates: ModeRates, prefix: str = "eval/") -> dict[str, float]:
    """Flat metrics for logging. The three headline rates are always present (nan when no item
    had two readable scores), so every logged step has the same keys; the rest are left out
    when undefined."""
    values: dict[str, Any] = {
        "error_rate": rates.error_rate,
        "mode_a_rate": rates.mode_a_rate,
        "mode_b_rate": rates.mode_b_rate,
        "unattributed_rate": rates.unattributed_rate,
        "probe_accuracy": rates.probe_accuracy,
        "n": float(rates.n),
        "unparsed_scores": float(rates.unparsed_scores),
        "unparsed_probes": float(rates.unparsed_probes),
    }
    always = ("error_rate", "mode_a_rate", "mode_b_rate")
    return {
        f"{prefix}{k}": float("nan") if v is None else float(v)
        for k, v in values.items()
        if v is not None or k in always
    }


def training_eval(cfg: Any, generate: Generate, step: int) -> dict[str, float]:
    """Held-out Mode a/b rates for the trainer, logged as `eval/*` in that step's metrics: the
    trainer's evaluation hook (`pjray.rl.trainer.Trainer(cfg, inputs, evaluate=training_eval)`).

    Scene items are built with `cfg.eval.train_seed` (validated to differ from the training
    data's seed) and judged by `generate`, the trainer's own rollout workers with the training
    sampling settings (the engines' sampling is fixed when they are built), one sample per prompt.
    """
    from pjray.ppjd.perturb import scene_items

    items = scene_items(
        cfg.eval.train_num_items,
        seed=cfg.eval.train_seed,
        num_candidates=3,
        image_size=cfg.data.image_size,
        kinds=cfg.data.scene_kinds,
        objects=cfg.data.scene_objects,
        split=cfg.eval.scene_split,
    )
    diag = [diagnosis_item(it) for it in items]
    rates, _, _ = diagnose(generate, diag, seed=cfg.eval.train_seed * 1_000_003 + step)
    return rates_metrics(rates)


def load_diagnosis_items(cfg: Any) -> tuple[list[DiagnosisItem], int, list[RowReject]]:
    """The items of `cfg.eval`: PPJD rows (`eval.data`: a parquet or a dataset) or scene items
    of `eval.scene_seed`. Returns (items, how many rows had no usable perturbation metadata, the
    rows rejected as unusable, within data.max_reject_fraction)."""
    e = cfg.eval
    rejects: list[RowReject] = []
    if e.data:
        from pjray.data.hf import eval_source, scan_judge_items

        scanned = scan_judge_items(eval_source(e))
        scanned.check(cfg.data.max_reject_fraction)
        raw, rejects = scanned.rows, scanned.rejects
    else:
        from pjray.ppjd.perturb import scene_items

        raw = scene_items(e.num_items, e.scene_seed, 3, e.image_size, e.scene_kinds, e.scene_objects, e.scene_split)
    items, skipped = [], 0
    for it in raw:
        try:
            items.append(diagnosis_item(it))
        except DiagnosisDataError:
            skipped += 1
        if e.limit and len(items) >= e.limit:
            break
    if not items:
        raise DiagnosisDataError(f"{e.data or 'scenes'}: no item carries perturbation records with probes")
    return items, skipped, rejects


def evaluate_modes(cfg: Any, generate: Generate) -> Any:
    """The Mode a/b report of `cfg.eval` (rates per seed, aggregated over seeds)."""
    from pjray.eval.metrics import Row
    from pjray.eval.report import EvalReport, seed_cells

    e = cfg.eval
    items, skipped, rejects = load_diagnosis_items(cfg)
    items = [replace(d, image=judged_image(d.image, e.image)) for d in items]
    per_seed, kinds_per_seed = [], []
    unparsed, outputs, examples = 0, 0, []
    for seed in e.seeds:
        rates, records, texts = diagnose(generate, items, seed)
        k = 0
        for d in items:
            span = texts[k : k + 2 + len(d.probes)]
            k += len(span)
            bad = [t for t in span[:2] if read_judge_score(t) is None]
            bad += [t for t in span[2:] if read_probe_answer(t) is None]
            unparsed += len(bad)
            outputs += len(span)
            examples += [t[:200].replace("\n", " ") for t in bad][: max(0, 5 - len(examples))]
        unread = rates.unparsed_scores + rates.unparsed_probes
        per_seed.append(
            {
                "error_rate": Row(rates.error_rate, rates.n, unread),
                "mode_a_rate": Row(rates.mode_a_rate, rates.n, unread),
                "mode_b_rate": Row(rates.mode_b_rate, rates.n, unread),
                "unattributed_rate": Row(rates.unattributed_rate, rates.n, unread),
                "probe_accuracy": Row(
                    rates.probe_accuracy, rates.n - rates.unparsed_probes + rates.unparsed_scores, rates.unparsed_probes
                ),
            }
        )
        by_kind: dict[str, list[ModeRecord]] = {}
        for d, r in zip(items, records):
            by_kind.setdefault(d.kind or "all", []).append(r)
        kinds_per_seed.append({kind: _kind_row(recs) for kind, recs in sorted(by_kind.items())})
    notes = [
        "error: score(wrong) >= score(correct) on the 1-10 score prompt; Mode (a): probe answered wrong, "
        "Mode (b): probe answered right; rates over items with both scores readable",
        "unattributed: errors whose probe answer could not be read",
        f"seeds aggregated by {e.seed_agg}",
    ]
    if skipped:
        notes.append(f"{skipped} items without perturbation records with probes were skipped")
    return EvalReport(
        bench="perceptual_bias",
        judge=e.judge,
        data=e.data,
        seeds=list(e.seeds),
        tables={
            "perceptual_bias": seed_cells(per_seed, e.seed_agg),
            "error_rate_by_kind": seed_cells(kinds_per_seed, e.seed_agg),
        },
        outputs=outputs,
        unparsed=unparsed,
        unparsed_examples=examples,
        notes=notes,
        convention="pjray: the paper's Mode (a) / Mode (b) diagnosis (pjray.eval.metrics.mode_rates)",
        rejects=rejects,
    )


def _kind_row(records: list[ModeRecord]) -> Any:
    from pjray.eval.metrics import Row

    rates = mode_rates(records)
    return Row(rates.error_rate, rates.n, rates.unparsed_scores)
