"""Does a judge use the image? The one protocol pjray measures it with: the check at the end of a
run from the base judge (`pjray.eval.held_out.held_out_check`), `pjray eval` (`eval.bench=looking`)
and the looking study (`benchmarks/study_looking.py`).

**Items.** K = 3 ranked tuples of one-object scenes of the held-out content split, of the
*independent* construction (`pjray.ppjd.perturb.CONSTRUCTIONS`: no wrong fact is shared, so the
correct answer is not the odd one out), question kinds alternating colour and size, letters
balanced per kind (`looking_items`, `balanced_letters`): a judge that keeps the shown order gets
chance, not a letter's luck. Each tuple is judged on three images with the same texts and
letters (`LookingItem`): the original scene; the swapped one (`pjray.ppjd.swap.swap_pair`), which
makes the perception-error answer the correct one; and the blank one (`blank_item`), the blind
control.

**Outcomes.** The primary rate is **image-following** (`looking_rates`, per kind and pooled): the
correct answer first on the original image AND the perception-error answer first on the swapped
one. The null a claim must beat is 1/(K-1)², a judge that drops the self-contradicting answer and
flips a coin on each image (`nulls`). The paired swap test (`swap_test`) asks whether the verdict
moves with the image at all. Verdicts are saved per item (`LookingVerdict`), also with the image
disposition forced (`forced_prefill`): the ceiling a judge born with a look mode reaches by one
token. A text shortcut on the blank scene, and a trained judge's image-following, are read against
the base judge forced onto its image disposition on the same items (`blank_change`,
`ceiling_test`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pjray.data.prompts import LETTERS, render_batch
from pjray.data.sampler import shown_order
from pjray.data.scenes import COLORS, SIZES, render
from pjray.eval.metrics import paired_test
from pjray.models.base_judge import disposition, forced_sentence
from pjray.ppjd.perturb import scene_items
from pjray.ppjd.shortcuts import scene_qa
from pjray.ppjd.swap import SWAP_KINDS, SwapPair, swap_pair
from pjray.types import JudgeItem, JudgePrompt

# generate(prompts) -> one greedy response text per prompt (its prefill not included).
Generate = Callable[[list[JudgePrompt]], list[str]]

K = 3
VALUES = {"color": COLORS, "size": SIZES}  # what an "Image: X." statement can name, per kind
BOOTSTRAP_DRAWS = 2000
# "Verdict: by the" starts the disposition sentence of pjray's base judges.
DISPOSITION_STEM = disposition(True).removesuffix(" image.")
_STATEMENT = re.compile(r"\s*Image: ([^.\n]*)\.")


# --------------------------------------------------------------------------- items


@dataclass(frozen=True)
class LookingItem:
    """One tuple under its three images, shown with the same letters (`shown`)."""

    pair: SwapPair  # the original item and its swapped counterfactual
    blank: JudgeItem  # the scene without its object
    shown: tuple[int, ...]  # letter i shows candidate shown[i] on every image

    @property
    def kind(self) -> str:
        return self.pair.kind

    def prompts(self) -> tuple[JudgePrompt, JudgePrompt, JudgePrompt]:
        """The batch-ranking prompts on the original, swapped and blank image."""
        items = (self.pair.original, self.pair.swapped, self.blank)
        return tuple(render_batch(it, None, shown=self.shown) for it in items)  # type: ignore[return-value]


def blank_item(item: JudgeItem) -> JudgeItem:
    """`item` with its scene re-rendered without any object: the same size and background, no
    value of any object attribute. Its `order` stays the original's (what correct-first reads).

    The blind control. A uniform grey image is not one: a judge reads grey as some colour or size
    ("blue", "large"), a fact that favours whichever candidate states it. With no object, nothing
    in the image can tell the candidates apart, while the prompt keeps its image (same size,
    background and image tokens). The judge's own words check it (`looking_rates`'
    `blank_states_truth`: how often its "Image: X." names the original image's value, beside the
    1/|values| of a value named at random): the base judge of model.init=base_judge names one
    constant value per kind on every blank scene, so what it says there depends on no item."""
    qa = scene_qa(item.meta)
    if qa is None:
        raise ValueError(f"item {item.id!r}: the blank control needs a scene item")
    return replace(
        item, id=f"{item.id}:blank", image=render(replace(qa.scene, objects=())), meta={**item.meta, "blank": True}
    )


def looking_items(items: Sequence[JudgeItem], letters_seed: int) -> list[LookingItem]:
    """`items` (scene tuples of `SWAP_KINDS`) under their three images, letters balanced per kind:
    the j-th item of a kind shows its levels in `shown_order(j, K, letters_seed)` (blocks of K!
    prompts, so with a multiple of K! items a kind each letter shows the correct answer, and the
    perception-error answer, equally often)."""
    seen: Counter[str] = Counter()
    out = []
    for item in items:
        pair = swap_pair(item)
        j = seen[pair.kind]
        seen[pair.kind] += 1
        shown = tuple(item.order[x] for x in shown_order(j, len(item.order), letters_seed))
        out.append(LookingItem(pair, blank_item(item), shown))
    return out


def held_out_tuples(
    per_kind: int, seed: int, image_size: int, objects: tuple[int, int], kinds: Sequence[str] = SWAP_KINDS
) -> list[JudgeItem]:
    """`per_kind` independent K = 3 tuples of each kind, of the held-out content split."""
    if per_kind % math.factorial(K):
        raise ValueError(f"{per_kind} tuples a kind: balanced letters need a multiple of {math.factorial(K)} (K!)")
    return scene_items(per_kind * len(kinds), seed, K, image_size, kinds, objects, "held_out", "independent")


def balanced_letters(items: Sequence[LookingItem]) -> None:
    """Fail unless, per kind, each letter shows the correct answer, and each shows the
    perception-error answer, equally often."""
    for kind in sorted({it.kind for it in items}):
        mine = [it for it in items if it.kind == kind]
        for level, name in ((0, "correct"), (1, "perception-error")):
            counts = Counter(it.shown.index(it.pair.original.order[level]) for it in mine)
            if len(counts) != len(mine[0].shown) or len(set(counts.values())) != 1:
                letters = {LETTERS[pos]: c for pos, c in sorted(counts.items())}
                raise AssertionError(f"{kind}: the {name} answer's letters are not balanced: {letters}")


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class LookingVerdict:
    """What a judge did on one `LookingItem` (candidate indices; None: no readable verdict).
    One parquet row a judge and item: the top choice on each image; whether the think text
    chooses the image ("Verdict: by the image.", the disposition sentence of pjray's base judges);
    and, when asked, the top choices with that disposition forced (`forced_prefill`: the judge's
    own "Image: X." kept, the sentence written for it, greedy from there)."""

    item_id: str
    kind: str
    truth: str  # the asked attribute's value in the original image
    swapped_to: str  # ... in the swapped image
    best: int  # the correct candidate on the original image
    perception_error: int  # the candidate the swapped image makes correct
    top_original: int | None
    top_swapped: int | None
    top_blank: int | None
    by_image_original: bool  # the think text chose the image
    by_image_swapped: bool
    by_image_blank: bool
    blank_statement: str | None  # what the think text says the blank image shows ("Image: X.")
    forced: bool = False  # whether the judge was also run with the image disposition forced
    forced_original: int | None = None  # the top choices with "Verdict: by the image." forced
    forced_swapped: int | None = None
    forced_blank: int | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)


def top_choice(text: str, prompt: JudgePrompt) -> int | None:
    """The candidate index a batch-ranking response puts first; None if it has no readable verdict."""
    from pjray.reward import judge_reward

    r = judge_reward(text, prompt.target, think_prefilled=True)
    if r.format != 1.0 or not r.pred:
        return None
    return prompt.shown[LETTERS.index(r.pred[0])]


def statement(text: str) -> str | None:
    """The value a think text's opening "Image: X." names, or None."""
    m = _STATEMENT.match(text)
    return m.group(1).strip() if m else None


def forced_prefill(text: str, sentence: str = disposition(True)) -> str:
    """The response opening that forces the image disposition: the judge's own "Image: X."
    statement (when its response opens with one), then `sentence` ("Verdict: by the image.";
    empty for a judge of one disposition, which is then run from its own statement)."""
    m = _STATEMENT.match(text)
    return " ".join(s for s in (m.group(0).strip() if m else "", sentence) if s)


def judge_looking(
    generate: Generate, items: Sequence[LookingItem], forced: bool, sentence: str = disposition(True)
) -> tuple[list[LookingVerdict], list[str]]:
    """The judge's verdicts on every item's three images (one `generate` call), and with
    `forced` once more with the image disposition (`sentence`, see `forced_prefill`) forced (a
    second call). Also returns its responses on the original images (for format and reward)."""
    prompts = [p for it in items for p in it.prompts()]  # item-major: original, swapped, blank
    texts = generate(prompts)
    if len(texts) != len(prompts):
        raise AssertionError(f"{len(texts)} responses to {len(prompts)} prompts")
    tops = [top_choice(t, p) for t, p in zip(texts, prompts)]
    forced_tops: list[int | None] = [None] * len(prompts)
    if forced:
        prefills = [forced_prefill(t, sentence) for t in texts]
        continued = generate([replace(p, prefill=f) for p, f in zip(prompts, prefills)])
        forced_tops = [top_choice(f + t, p) for f, t, p in zip(prefills, continued, prompts)]
    verdicts = []
    for i, it in enumerate(items):
        o, s, b = 3 * i, 3 * i + 1, 3 * i + 2
        verdicts.append(
            LookingVerdict(
                item_id=it.pair.original.id,
                kind=it.kind,
                truth=it.pair.shown[0],
                swapped_to=it.pair.shown[1],
                best=it.pair.original.order[0],
                perception_error=it.pair.original.order[1],
                top_original=tops[o],
                top_swapped=tops[s],
                top_blank=tops[b],
                by_image_original=DISPOSITION_STEM + " image" in texts[o],
                by_image_swapped=DISPOSITION_STEM + " image" in texts[s],
                by_image_blank=DISPOSITION_STEM + " image" in texts[b],
                blank_statement=statement(texts[b]),
                forced=forced,
                forced_original=forced_tops[o],
                forced_swapped=forced_tops[s],
                forced_blank=forced_tops[b],
            )
        )
    return verdicts, texts[0::3]


# --------------------------------------------------------------------------- rates


def follows_image(v: LookingVerdict, forced: bool = False) -> tuple[bool, bool]:
    """(correct first on the original image, the perception-error answer first on the swapped)."""
    top = (v.forced_original, v.forced_swapped) if forced else (v.top_original, v.top_swapped)
    return top[0] is not None and top[0] == v.best, top[1] is not None and top[1] == v.perception_error


def nulls(k: int) -> dict[str, float]:
    """Image-following of judges that do not look, for k candidates: one that ranks from the text
    alone keeps its top choice under both images (0); one that picks at random on each image
    (1/k²); one that drops the self-contradicting answer (its reasoning error is visible in the
    text), then flips a coin on each image (1/(k-1)²): the null a claim must beat."""
    return {"text_only": 0.0, "random": 1 / k**2, "drop_contradicting": 1 / (k - 1) ** 2}


def swap_test(verdicts: Sequence[LookingVerdict]) -> dict[str, float]:
    """The paired swap test: per item, the perception-error answer first on the swapped image (the
    first of each pair) and on the original; exact McNemar (b: first on the swapped image only, c:
    on the original only). p is small only when the verdict moves with the image: a judge whose
    verdict ignores the image puts the same answer first on both (no discordant pair, p = 1). The
    fixed `nulls` are for the rate, this test for the link between image and verdict."""

    def first(top: int | None, v: LookingVerdict) -> bool:
        return top is not None and top == v.perception_error

    t = paired_test([first(v.top_swapped, v) for v in verdicts], [first(v.top_original, v) for v in verdicts])
    return {
        "perception_error_first_swapped": round(t.accuracy_first or 0.0, 4),
        "perception_error_first_original": round(t.accuracy_second or 0.0, 4),
        "b": t.b,
        "c": t.c,
        "p": t.p_value,
    }


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def looking_rates(verdicts: Sequence[LookingVerdict]) -> dict[str, Any]:
    """The rates of `verdicts` (one slice: a kind, or all pooled), with image-following's nulls
    and interval and the paired swap test. Forced rates when the verdicts have them."""
    n = len(verdicts)

    def rate(hits: Sequence[bool]) -> float:
        return round(sum(hits) / max(1, n), 4)

    hits = [follows_image(v) for v in verdicts]
    following = sum(a and b for a, b in hits)
    out: dict[str, Any] = {
        "items": n,
        "correct_first": rate([a for a, _ in hits]),
        "correct_first_swapped": rate([b for _, b in hits]),
        "image_following": rate([a and b for a, b in hits]),
        "image_following_ci": wilson(following, n),
        "nulls": nulls(K),
        "swap_test": swap_test(verdicts),
        "same_top": rate([v.top_original is not None and v.top_original == v.top_swapped for v in verdicts]),
        "blank_correct_first": rate([v.top_blank is not None and v.top_blank == v.best for v in verdicts]),
        "blank_states_truth": rate([v.blank_statement == v.truth for v in verdicts]),
        "blank_states_truth_chance": round(float(np.mean([1 / len(VALUES[v.kind]) for v in verdicts])), 4)
        if n
        else 0.0,
        "blank_states_a_value": rate([v.blank_statement in VALUES[v.kind] for v in verdicts]),
        "disposition_image": rate([v.by_image_original for v in verdicts]),
        "forced": None,
    }
    if verdicts and all(v.forced for v in verdicts):
        forced = [follows_image(v, forced=True) for v in verdicts]
        out["forced"] = {
            "correct_first": rate([a for a, _ in forced]),
            "image_following": rate([a and b for a, b in forced]),
            "blank_correct_first": rate([v.forced_blank is not None and v.forced_blank == v.best for v in verdicts]),
        }
    return out


Part = Callable[[LookingVerdict], str]  # the part of the task an item is of ("taught", "untaught")


def looking_report(verdicts: Sequence[LookingVerdict], part: Part | None = None) -> dict[str, dict[str, Any]]:
    """`looking_rates` of each slice of `_slices`: pooled, per kind, and with `part` per part and
    per kind and part."""
    return {s: looking_rates([verdicts[i] for i in keep]) for s, keep in _slices(verdicts, part).items()}


def paired_change(
    before: Sequence[bool], after: Sequence[bool], reps: int = BOOTSTRAP_DRAWS, seed: int = 0
) -> dict[str, float]:
    """The mean change after - before over paired items, with a 95% percentile bootstrap
    interval over the items."""
    d = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    if not len(d):
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    draws = np.random.default_rng(seed).integers(0, len(d), size=(reps, len(d)))
    lo, hi = np.percentile(d[draws].mean(axis=1), [2.5, 97.5])
    return {"mean": round(float(d.mean()), 4), "lo": round(float(lo), 4), "hi": round(float(hi), 4)}


def _slices(verdicts: Sequence[LookingVerdict], part: Part | None = None) -> dict[str, list[int]]:
    """Item indices per slice: "pooled", each kind, and with `part` each part ("taught") and each
    kind and part ("color/untaught")."""

    def names(v: LookingVerdict) -> list[str]:
        return ["pooled", v.kind, *((part(v), f"{v.kind}/{part(v)}") if part is not None else ())]

    order = ["pooled", *sorted({n for v in verdicts for n in names(v)} - {"pooled"})]
    return {name: [i for i, v in enumerate(verdicts) if name in names(v)] for name in order}


def _same_items(base: Sequence[LookingVerdict], judge: Sequence[LookingVerdict]) -> None:
    if [v.item_id for v in base] != [v.item_id for v in judge]:
        raise ValueError("the two judges' verdicts are not on the same items")


def blank_change(
    base: Sequence[LookingVerdict], judge: Sequence[LookingVerdict], part: Part | None = None
) -> dict[str, dict[str, float]]:
    """The judge's correct-first on the blank control minus the base judge's with its image
    disposition forced (its own blank verdicts where it has none forced), paired by item, pooled
    and per kind. The disposition alone moves the blank verdicts by kind, so a text shortcut is
    claimed only against the forced base judge, and only where the interval is above 0."""
    _same_items(base, judge)

    def hit(top: int | None, v: LookingVerdict) -> bool:
        return top is not None and top == v.best

    base_hits = [hit(v.forced_blank if v.forced else v.top_blank, v) for v in base]
    judge_hits = [hit(v.top_blank, v) for v in judge]
    return {
        s: paired_change([base_hits[i] for i in keep], [judge_hits[i] for i in keep])
        for s, keep in _slices(base, part).items()
    }


def ceiling_test(
    base: Sequence[LookingVerdict], judge: Sequence[LookingVerdict], part: Part | None = None
) -> dict[str, dict[str, float]]:
    """The judge's image-following against the base judge's forced ceiling, paired by item, pooled
    and per kind: exact McNemar (b: the judge follows the image where the forced base judge does
    not, c: the reverse)."""
    _same_items(base, judge)
    mine = [all(follows_image(v)) for v in judge]
    ceiling = [all(follows_image(v, forced=True)) for v in base]
    out = {}
    for s, keep in _slices(base, part).items():
        t = paired_test([mine[i] for i in keep], [ceiling[i] for i in keep])
        out[s] = {
            "judge": round(t.accuracy_first or 0.0, 4),
            "forced_base": round(t.accuracy_second or 0.0, 4),
            "b": t.b,
            "c": t.c,
            "p": t.p_value,
        }
    return out


# --------------------------------------------------------------------------- pjray eval

ITEMS_FILE = "looking_items.parquet"  # in eval.output_dir: one row per seed and item
READ = ("top_original", "top_swapped", "top_blank", "forced_original", "forced_swapped", "forced_blank")


def evaluate_looking(cfg: Any, generate: Callable[[list[JudgePrompt], int], list[str]]) -> Any:
    """`pjray eval` with eval.bench=looking: the protocol on `eval.num_items` held-out tuples of
    `eval.scene_kinds` (eval.scene_seed, image size, objects, content split), per seed of
    eval.seeds, the judge also with the image disposition forced (`eval.force_disposition`);
    per-item verdicts in `<output_dir>/looking_items.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pjray.eval.metrics import Row
    from pjray.eval.report import EvalReport, seed_cells

    e = cfg.eval
    sentence = forced_sentence(e.force_disposition)
    raw = scene_items(
        e.num_items, e.scene_seed, K, e.image_size, e.scene_kinds, tuple(e.scene_objects), e.scene_split, "independent"
    )
    items = looking_items(raw, letters_seed=e.scene_seed)
    balanced_letters(items)
    per_seed, rows = [], []
    for seed in e.seeds:
        verdicts, _ = judge_looking(lambda ps: generate(ps, seed), items, forced=True, sentence=sentence)
        rows += [{"seed": seed, **v.row()} for v in verdicts]
        report = looking_report(verdicts)
        table: dict[str, dict[str, Row]] = {}
        for s, r in report.items():
            n = r["items"]
            for metric in ("image_following", "correct_first", "blank_correct_first", "disposition_image"):
                table.setdefault(metric, {})[s] = Row(r[metric], n)
            table.setdefault("forced_image_following", {})[s] = Row(r["forced"]["image_following"], n)
            table.setdefault("swap_test_p", {})[s] = Row(r["swap_test"]["p"], n)
        per_seed.append(table)
    out = Path(e.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / ITEMS_FILE)
    tables = {metric: seed_cells([t[metric] for t in per_seed], e.seed_agg) for metric in per_seed[0]}
    null = nulls(K)
    notes = [
        f"image-following: correct first on the image AND the perception-error answer first on the swapped image; "
        f"nulls for K={K}: text-only {null['text_only']:.0%}, random {null['random']:.0%}, drop the "
        f"self-contradicting answer and guess per image {null['drop_contradicting']:.0%}; swap_test_p: the paired "
        "swap test (exact McNemar on the perception-error answer first on the swapped vs the original image, per item)",
        "blank_correct_first: the scene without its object (no value to read); forced_image_following: "
        + (
            f'with "{sentence}" written for the judge after its own "Image: X."'
            if sentence
            else 'the judge\'s own "Image: X." kept and nothing more written (eval.force_disposition=false)'
        ),
        f"independent tuples, letters balanced per kind; per-item verdicts in {ITEMS_FILE}",
    ]
    return EvalReport(
        bench="looking",
        judge=e.judge,
        data="",
        seeds=list(e.seeds),
        tables=tables,
        outputs=len(rows) * len(READ),
        unparsed=sum(r[k] is None for r in rows for k in READ),
        notes=notes,
        convention="pjray: the looking protocol (pjray.eval.looking)",
    )
