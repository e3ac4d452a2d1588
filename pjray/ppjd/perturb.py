"""Rule-based perceptual and reasoning perturbations of scene answers, and ranked PPJD items.

This is the rules backend of the PPJD "rewrite rejecteds" step for synthetic scenes, where the
ground truth is known exactly, so no LLM is needed and every perturbation can be verified.

- A *perception error* edits what the answer claims to see (a colour, shape, size or location of
  an object it mentions). The answer is recomposed from the edited view, so every mention changes
  together, the steps keep their structure and wording, and the final follows from the steps.
  The first perception error is always *decisive*: it makes the final answer wrong.
- A *reasoning error* overrides one derived step (a count that does not match the listing, a
  conclusion that does not follow, a restatement that contradicts an earlier step); the
  perception errors stay, and the final stays wrong.

Ranked levels for K candidates, best -> worst (`ranked_item`, `construct_levels`): K = 3 is the
paper's chosen > perception-only > perception+reasoning tuple. The *nested* construction
(`ranked_levels`: 0 chosen | 1 P | 2 P+R | 3 PP+R ...) can be ranked from the text alone: the two
wrong candidates state the same wrong fact, so the correct one is the odd one out, and the worst
one contradicts itself. The *independent* construction (`independent_levels`) gives every wrong
candidate its own decisive perception error with a different wrong value, so only the image
tells the best candidate from the other intact one. Both keep the order strict in the number of
errors.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from pjray.config.data import CONSTRUCTIONS  # defined with the config that checks values against it
from pjray.data.scenes import (
    COLORS,
    KINDS,
    LOCATIONS,
    SHAPES,
    SIZE_QUESTION,
    SIZES,
    SceneQA,
    Seen,
    answer_text,
    compose_answer,
    location_cell,
    location_name,
    matches,
    mentioned_attributes,
    render,
    split_qas,
    true_view,
)
from pjray.types import JudgeItem

# Every question kind yields at least this many strictly ranked candidates.
MAX_CANDIDATES = 6

_VALUES: dict[str, tuple[str, ...]] = {"color": COLORS, "shape": SHAPES, "size": SIZES, "location": LOCATIONS}


@dataclass(frozen=True)
class Change:
    """One perception fact as a perturbed answer states it, against the truth."""

    obj: int
    attribute: str
    original: str  # the true value
    perturbed: str  # the value the answer claims

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Probe:
    """A VQA probe for one changed fact: asked about the image, its true answer is `answer`."""

    question: str
    answer: str
    obj: int
    attribute: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Break:
    """One reasoning error: derived slot `slot` states `value` instead of what follows.

    `kind`: "miscount" (a number that does not match the listed shapes), "non_sequitur" (a
    conclusion or comparison that does not follow from the step before), "contradiction" (a
    restatement that contradicts an earlier step). `step` is the index of the broken step.
    `salt` picks among the valid wrong values, so the value can be recomputed when later
    perception errors change the view.
    """

    kind: str
    slot: str
    step: int
    value: str
    salt: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "slot": self.slot, "step": self.step, "value": self.value}


@dataclass(frozen=True)
class Perturbed:
    """An answer to `qa` written from a perturbed view, with what was changed."""

    qa: SceneQA
    view: tuple[Seen, ...]
    errors: tuple[tuple[Change, ...], ...]  # perception errors; one error may move two facts (a mirror)
    breaks: tuple[Break, ...]  # reasoning errors
    steps: tuple[str, ...]
    final: str

    @property
    def text(self) -> str:
        return answer_text(self.steps, self.final)

    @property
    def changes(self) -> tuple[Change, ...]:
        return tuple(c for group in self.errors for c in group)

    @property
    def error_count(self) -> int:
        return len(self.errors) + len(self.breaks)

    @property
    def probes(self) -> tuple[Probe, ...]:
        return tuple(probe_for(self.qa, c) for c in self.changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "perception_errors": len(self.errors),
            "reasoning_errors": len(self.breaks),
            "changes": [[c.to_json() for c in group] for group in self.errors],
            "breaks": [b.to_json() for b in self.breaks],
            "probes": [p.to_json() for p in self.probes],
            "final": self.final,
        }


# --------------------------------------------------------------------------- answer helpers

_BOXED = "\\boxed{"
_FINAL_RE = re.compile(r"final\s+answer\s*\**\s*:\s*\**\s*(.+)", re.IGNORECASE)
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
_ARTICLES = {"a", "an", "the"}


def final_answer(text: str) -> str | None:
    """The final answer of a response: the last `\\boxed{...}`, else the last "Final Answer:" line."""
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        # An unclosed box is not an answer; fall through to the "Final Answer:" form.
    matches = _FINAL_RE.findall(text)
    if not matches:
        return None
    value = matches[-1].strip().strip("*$").strip()
    value = value.rstrip(".").strip()
    return value or None


def normalize_answer(s: str) -> str:
    """Canonical form for comparing finals: lowercase, no punctuation or articles, digits for numbers."""
    s = s.lower()
    s = re.sub(r"[^\w\s./-]", " ", s)
    s = re.sub(r"(?<!\d)[./-]|[./-](?!\d)", " ", s)  # keep "3.5" and "1/4", drop other punctuation
    words = [_NUMBER_WORDS.get(w, w) for w in s.split() if w not in _ARTICLES]
    return " ".join(words)


def same_answer(a: str | None, b: str | None) -> bool:
    """Whether two final answers are the same once normalized (neither missing)."""
    return a is not None and b is not None and normalize_answer(a) == normalize_answer(b)


# --------------------------------------------------------------------------- probes


def probe_for(qa: SceneQA, change: Change) -> Probe:
    """A question about the image whose true answer settles the changed fact."""
    o = qa.scene.objects[change.obj]
    question = {
        "color": f"What color is the shape at the {o.location}?",
        "shape": f"What shape is at the {o.location}?",
        "size": f"Is the shape at the {o.location} {SIZE_QUESTION}?",
        "location": f"Where in the image is the {o.color} {o.shape}?",
    }[change.attribute]
    return Probe(question, change.original, change.obj, change.attribute)


# --------------------------------------------------------------------------- perception errors


def unperturbed(qa: SceneQA) -> Perturbed:
    """The chosen answer as a `Perturbed` with no errors (level 0)."""
    return Perturbed(qa, true_view(qa.scene), (), (), qa.steps, qa.final)


def _set(view: tuple[Seen, ...], obj: int, attribute: str, value: str) -> tuple[Seen, ...]:
    return tuple(replace(s, **{attribute: value}) if i == obj else s for i, s in enumerate(view))


def _perception_final(qa: SceneQA, view: tuple[Seen, ...]) -> str:
    return compose_answer(qa.spec, view)[1]


def _mirror(qa: SceneQA, view: tuple[Seen, ...]) -> tuple[Change, ...]:
    """Spatial: swap left<->right (or top<->bottom) for both objects; flips the asked relation."""
    horizontal = qa.spec.param("axis") == "horizontal"
    changes = []
    for i in qa.spec.subjects:
        row, col = location_cell(view[i].location)
        moved = location_name(row, 2 - col) if horizontal else location_name(2 - row, col)
        if moved != view[i].location:  # a middle column (row) object stays put
            changes.append(Change(i, "location", qa.scene.objects[i].location, moved))
    return tuple(changes)


def _apply(view: tuple[Seen, ...], changes: tuple[Change, ...]) -> tuple[Seen, ...]:
    for c in changes:
        view = _set(view, c.obj, c.attribute, c.perturbed)
    return view


def perception_options(p: Perturbed) -> list[tuple[Change, ...]]:
    """Every perception error that can be added to `p` and leaves its final wrong.

    Each option touches facts not changed before, so errors never undo each other. For a
    spatial question the first error is the mirror; later ones change the stated sizes.
    """
    qa, view = p.qa, p.view
    truth = qa.final
    if qa.kind == "spatial" and not p.errors:
        return [_mirror(qa, view)]
    attributes = ("size",) if qa.kind == "spatial" else mentioned_attributes(qa.kind)
    done = {(c.obj, c.attribute) for c in p.changes}
    claimed = {s.location for s in view}
    options = []
    for i in qa.spec.subjects:
        for attribute in attributes:
            if (i, attribute) in done:
                continue
            current = getattr(view[i], attribute)
            for value in _VALUES[attribute]:
                # A moved object goes to a free cell so the listing stays a plausible picture.
                if value == current or (attribute == "location" and value in claimed):
                    continue
                change = Change(i, attribute, getattr(qa.scene.objects[i], attribute), value)
                if not same_answer(_perception_final(qa, _set(view, i, attribute, value)), truth):
                    options.append((change,))
    # Real scenes never hold two objects of the same colour and shape; a listing that does would
    # give the perturbation away without a look at the image, so avoid it where possible.
    unique = [g for g in options if not _has_twins(qa, _apply(view, g))]
    return unique or options


def _has_twins(qa: SceneQA, view: tuple[Seen, ...]) -> bool:
    pairs = [(view[i].color, view[i].shape) for i in qa.spec.subjects]
    return len(set(pairs)) < len(pairs)


def add_perception_error(p: Perturbed, rng: random.Random) -> Perturbed:
    """`p` with one more perception error (reasoning errors kept, their values re-derived)."""
    options = perception_options(p)
    if not options:
        raise ValueError(f"no further perception error possible for a {p.qa.kind} question: {p.qa.question!r}")
    # Draw the (object, attribute) first and then the value, so attributes with many values
    # (colours, locations) do not crowd out sizes and shapes.
    keys = sorted({(g[0].obj, g[0].attribute) for g in options})
    key = keys[rng.randrange(len(keys))]
    group = rng.choice([g for g in options if (g[0].obj, g[0].attribute) == key])
    view = _apply(p.view, group)
    return _build(p.qa, view, p.errors + (group,), p.breaks)


def perceptual_perturb(qa: SceneQA, rng: random.Random) -> Perturbed:
    """The perception-only counterfactual: one decisive perception error, reasoning intact."""
    return add_perception_error(unperturbed(qa), rng)


# --------------------------------------------------------------------------- reasoning errors

# (question kind) -> [(break kind, slot)] that can be broken.
_BREAK_SITES: dict[str, tuple[tuple[str, str], ...]] = {
    "color": (
        ("non_sequitur", "conclusion_color"),
        ("contradiction", "conclusion_size"),
        ("contradiction", "conclusion_shape"),
    ),
    "size": (("contradiction", "conclusion_color"), ("contradiction", "conclusion_shape")),
    "spatial": (
        ("non_sequitur", "comparison"),
        ("contradiction", "conclusion_a_size"),
        ("contradiction", "conclusion_b_size"),
    ),
    "count": (("miscount", "number"),),
    "existence": (("miscount", "number"),),
}


def _break_values(qa: SceneQA, view: tuple[Seen, ...], slot: str) -> list[str]:
    """Values of `slot` that do not follow from `view`, preferring ones that are also false."""
    spec, truth_view = qa.spec, true_view(qa.scene)
    if slot == "number":
        m, t = (sum(matches(spec, v[i]) for i in spec.subjects) for v in (view, truth_view))
        return [str(n) for n in (m + 1, m - 1, m + 2, m - 2) if n >= 0 and n not in (m, t)]
    if slot == "comparison":
        horizontal = spec.param("axis") == "horizontal"
        ia, ib = spec.subjects
        (ra, ca), (rb, cb) = location_cell(view[ia].location), location_cell(view[ib].location)
        if horizontal:
            return ["right" if ca < cb else "left"]
        return ["lower" if ra < rb else "higher"]
    if slot == "conclusion_a_size" or slot == "conclusion_b_size":
        i = spec.subjects[0 if slot == "conclusion_a_size" else 1]
        return [s for s in SIZES if s != view[i].size]
    attribute = slot.removeprefix("conclusion_")
    i = spec.subjects[0]
    stated, true = getattr(view[i], attribute), getattr(truth_view[i], attribute)
    wrong = [v for v in _VALUES[attribute] if v != stated]
    also_false = [v for v in wrong if v != true]
    return also_false or wrong


def _build(
    qa: SceneQA, view: tuple[Seen, ...], errors: tuple[tuple[Change, ...], ...], breaks: tuple[Break, ...]
) -> Perturbed:
    """Compose the answer for `view` with `breaks`, re-deriving each break's value and step."""
    clean_steps, _ = compose_answer(qa.spec, view)
    rebuilt: list[Break] = []
    for b in breaks:
        values = _break_values(qa, view, b.slot)
        value = values[b.salt % len(values)]
        broken_steps, _ = compose_answer(qa.spec, view, {b.slot: value})
        step = next(i for i, (x, y) in enumerate(zip(clean_steps, broken_steps)) if x != y)
        rebuilt.append(replace(b, value=value, step=step))
    steps, final = compose_answer(qa.spec, view, {b.slot: b.value for b in rebuilt})
    if errors and same_answer(final, qa.final):
        raise AssertionError(f"perturbed answer became right: {qa.question!r} -> {final!r}")
    return Perturbed(qa, view, errors, tuple(rebuilt), steps, final)


def _free_break_sites(p: Perturbed) -> list[tuple[str, str]]:
    used = {b.slot for b in p.breaks}
    return [s for s in _BREAK_SITES[p.qa.kind] if s[1] not in used]


def reasoning_perturb(p: Perturbed, rng: random.Random) -> Perturbed:
    """`p` with one reasoning error added; its perception errors stay and the final stays wrong."""
    if not p.errors:
        raise ValueError("reasoning_perturb expects a perception-perturbed answer (its final must be wrong)")
    return add_reasoning_error(p, rng)


def add_reasoning_error(p: Perturbed, rng: random.Random) -> Perturbed:
    """`p` with one more reasoning error, at a slot not broken yet."""
    sites = _free_break_sites(p)
    if not sites:
        raise ValueError(f"no further reasoning error possible for a {p.qa.kind} question")
    kind, slot = sites[rng.randrange(len(sites))]
    new = Break(kind, slot, step=-1, value="", salt=rng.randrange(1 << 30))
    return _build(p.qa, p.view, p.errors, p.breaks + (new,))


# --------------------------------------------------------------------------- ranked items


def reasoning_only_levels(qa: SceneQA, num_candidates: int, rng: random.Random) -> list[Perturbed]:
    """Levels 0..K-1 with reasoning errors only (0, 1, 2, ... broken steps; perception intact):
    the data of the ablation without perception perturbations."""
    levels = [unperturbed(qa)]
    while len(levels) < num_candidates:
        if not _free_break_sites(levels[-1]):
            raise ValueError(
                f"num_candidates={num_candidates}: a {qa.kind} question has {len(levels) - 1} reasoning-error sites"
            )
        levels.append(add_reasoning_error(levels[-1], rng))
    return levels


def ranked_levels(qa: SceneQA, num_candidates: int, rng: random.Random) -> list[Perturbed]:
    """Levels 0..K-1 (best -> worst), each with one more error than the one before:
    0 chosen | 1 P | 2 P+R | 3 PP+R | 4 PPP+R ... (once a question has no perception fact left to
    change, further levels add reasoning errors), so each level's errors include the previous
    level's: the nested construction."""
    if num_candidates < 2:
        raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")
    levels = [unperturbed(qa), perceptual_perturb(qa, rng)]
    if num_candidates >= 3:
        levels.append(reasoning_perturb(levels[1], rng))
    while len(levels) < num_candidates:
        # More perception errors first; when a question has no facts left to change, more
        # reasoning errors (every kind supports MAX_CANDIDATES levels this way).
        last = levels[-1]
        if perception_options(last):
            levels.append(add_perception_error(last, rng))
        elif _free_break_sites(last):
            levels.append(reasoning_perturb(last, rng))
        else:
            raise ValueError(
                f"num_candidates={num_candidates}: a {qa.kind} question supports at most {len(levels)} "
                f"ranked levels here (every kind supports {MAX_CANDIDATES})"
            )
    if len({p.text for p in levels}) != len(levels):
        raise AssertionError(f"two ranked levels have the same text: {qa.question!r}")
    return levels


_TRIES = 64  # draws per level before the independent construction gives up on a question


def independent_levels(qa: SceneQA, num_candidates: int, rng: random.Random) -> list[Perturbed]:
    """Levels 0..K-1 (best -> worst) in which every wrong candidate has its own decisive
    perception error with a different wrong value, no two candidates state the same wrong fact
    or the same final answer, and level l has l errors (one perception error, then reasoning
    errors, then further perception errors). Raises ValueError when the question cannot carry
    K - 1 distinct wrong answers (a spatial or existence question has one; a size question two).

    K = 3: "red" correct, "blue" with its reasoning intact, "green" with a reasoning error, so no
    wrong fact or final answer is shared. Level l >= 2 adds l - 1 reasoning errors to its own
    perception error (then non-decisive perception errors, never a fact another level states),
    so the order stays strict in the number of errors."""
    if num_candidates < 2:
        raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")
    levels = [unperturbed(qa)]
    finals = {normalize_answer(qa.final)}
    stated: set[tuple[int, str, str]] = set()  # wrong facts some level states
    for level in range(1, num_candidates):
        for _ in range(_TRIES):
            p = _independent_level(qa, level, stated, rng)
            if p is not None and normalize_answer(p.final) not in finals:
                break
        else:
            raise ValueError(
                f"independent construction: a {qa.kind} question has no {num_candidates - 1} wrong answers that "
                f"differ in fact and final answer ({qa.question!r})"
            )
        levels.append(p)
        finals.add(normalize_answer(p.final))
        stated |= {(c.obj, c.attribute, c.perturbed) for c in p.changes}
    return levels


def _independent_level(
    qa: SceneQA, level: int, stated: set[tuple[int, str, str]], rng: random.Random
) -> Perturbed | None:
    """One draw of a level with `level` errors whose perception facts are not in `stated`, or
    None where this draw ran out of options."""

    def fresh(p: Perturbed) -> list[tuple[Change, ...]]:
        return [g for g in perception_options(p) if not any((c.obj, c.attribute, c.perturbed) in stated for c in g)]

    p = unperturbed(qa)
    options = fresh(p)
    if not options:
        return None
    group = rng.choice(options)
    p = _build(qa, _apply(p.view, group), (group,), ())
    while p.error_count < level:
        if _free_break_sites(p):
            p = add_reasoning_error(p, rng)
            continue
        options = fresh(p)
        if not options:
            return None
        group = rng.choice(options)
        p = _build(qa, _apply(p.view, group), p.errors + (group,), p.breaks)
    return p


def construct_levels(
    qa: SceneQA, num_candidates: int, rng: random.Random, construction: str = "nested"
) -> list[Perturbed]:
    """The ranked levels of `construction` (CONSTRUCTIONS): `ranked_levels` or `independent_levels`."""
    if construction == "nested":
        return ranked_levels(qa, num_candidates, rng)
    if construction == "independent":
        return independent_levels(qa, num_candidates, rng)
    raise ValueError(f"unknown PPJD construction {construction!r}; expected one of {CONSTRUCTIONS}")


def item_id(qa: SceneQA) -> str:
    """Stable id from the scene seed, image size and question."""
    digest = hashlib.sha1(f"{qa.scene.width}:{qa.question}".encode()).hexdigest()[:8]
    return f"scenes-{qa.scene.seed}-{qa.kind}-{digest}"


def ranked_item(
    qa: SceneQA,
    num_candidates: int = 3,
    rng: random.Random | None = None,
    perception: bool = True,
    construction: str = "nested",
) -> JudgeItem:
    """A ranked PPJD item: chosen > perception-only > perception+reasoning (> more errors ...),
    levels built by `construction` (`construct_levels`); with `perception=False`, chosen > one
    reasoning error > two ... (`reasoning_only_levels`).

    Candidates are stored shuffled; `order` lists their indices best -> worst. `meta["levels"]`
    holds each level's perturbation record, best -> worst, with the candidate index it landed at.
    """
    if rng is None:
        # Not seeded by K: the levels of a K-item are then those of the (K-1)-item plus one.
        rng = random.Random(f"pjray.ppjd.rank:{item_id(qa)}")
    if perception:
        levels = construct_levels(qa, num_candidates, rng, construction)
    else:
        levels = reasoning_only_levels(qa, num_candidates, rng)
    slots = list(range(num_candidates))
    rng.shuffle(slots)  # level l is stored at candidates[slots[l]]
    candidates = [""] * num_candidates
    for level, slot in zip(levels, slots):
        candidates[slot] = level.text
    meta = {
        "kind": qa.kind,
        "construction": construction if perception else "reasoning_only",
        "scene_seed": qa.scene.seed,
        "image_size": qa.scene.width,
        "objects": list(qa.scene.object_range),
        "truth": qa.final,
        "facts": [f.to_json() for f in qa.facts],
        "levels": [{"candidate": slot, **level.to_json()} for level, slot in zip(levels, slots)],
    }
    return JudgeItem(
        id=item_id(qa),
        image=render(qa.scene),
        question=qa.question,
        candidates=tuple(candidates),
        order=tuple(slots),
        source="scenes",
        meta=meta,
    )


def _scene_seed(seed: int, index: int) -> int:
    """Independent-looking 31-bit scene seeds for (seed, index), stable across runs."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:4], "big") >> 1


def scene_items(
    n: int,
    seed: int = 0,
    num_candidates: int = 3,
    image_size: int = 128,
    kinds: Sequence[str] = KINDS,
    objects: Sequence[int] = (2, 5),
    split: str = "all",
    construction: str = "nested",
) -> list[JudgeItem]:
    """`n` ranked scene items; question kinds cycle through `kinds` so they are balanced, each
    scene holds `objects` = (min, max) objects and lies in the content `split`
    (`pjray.data.scenes.SPLITS`)."""
    qas = split_qas(n, lambda i: _scene_seed(seed, i), split, image_size, kinds, objects)
    return [ranked_item(qa, num_candidates, construction=construction) for qa in qas]
