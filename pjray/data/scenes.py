"""Deterministic synthetic scenes with ground-truth facts, and grounded question/answer pairs.

A scene is a plain background with 1-9 (by default 2-5) flat-coloured shapes, each in its own
cell of a 3x3 grid.
One object per cell makes every object nameable by its position ("the shape at the top left"),
keeps shapes apart by a margin, and makes left/right and above/below unambiguous for any two
objects in different columns (rows): their pixel extents do not even overlap on that axis.
The (colour, shape) pair of every object is unique, so "the red circle" names one object too.

Answers are composed from a *view*: what the answerer believes it sees (one `Seen` per object).
The chosen answer uses the true view; the perturber in `pjray.ppjd.perturb` edits the view (and,
for reasoning errors, overrides a derived slot) and calls the same `compose_answer`, so every
mention of a changed attribute changes together and the step structure stays identical.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw

# The question kinds and content splits, defined with the config that checks values against them.
from pjray.config.data import KINDS, SPLITS

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "medium", "large")
# Far apart in RGB so that a pixel's colour names its object without any tolerance.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 50, 170),
    "orange": (250, 130, 20),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
ROWS: tuple[str, ...] = ("top", "center", "bottom")
COLS: tuple[str, ...] = ("left", "center", "right")
# How wide each size looks, as a fraction of the image width (radii are chosen to match). Three
# sizes, so that a size question has two wrong answers that differ (PPJD's independent
# construction gives each wrong candidate its own wrong fact).
SIZE_FRACTION: dict[str, str] = {"small": "1/8", "medium": "3/16", "large": "1/4"}
_CELL_GAP = 2  # pixels kept free inside each cell border, so neighbours never touch
MIN_IMAGE_SIZE = 64


def location_name(row: int, col: int) -> str:
    """Grid cell -> phrase: (0, 0) -> "top left", (1, 1) -> "center", (1, 2) -> "center right"."""
    if row == 1 and col == 1:
        return "center"
    return f"{ROWS[row]} {COLS[col]}"


LOCATIONS: tuple[str, ...] = tuple(location_name(r, c) for r in range(3) for c in range(3))
_CELL_OF: dict[str, tuple[int, int]] = {location_name(r, c): (r, c) for r in range(3) for c in range(3)}


SIZE_QUESTION = "small, medium or large"  # how a question asks for a size


def location_cell(name: str) -> tuple[int, int]:
    """Inverse of `location_name`."""
    return _CELL_OF[name]


def size_radius(size: str, image_size: int) -> int:
    """Pixel radius (half extent) of a shape: small spans ~1/8 of the image, medium ~3/16, large ~1/4."""
    if size == "small":
        return round(image_size / 16)
    if size == "medium":
        return round(3 * image_size / 32)
    return round(image_size / 8) - 1


def article(word: str) -> str:
    """The indefinite article for a word ("an orange", "a red")."""
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class SceneObject:
    """One flat-coloured shape. (x, y) is the centre of its bounding box, in pixels."""

    shape: str  # one of SHAPES
    color: str  # one of COLORS
    size: str  # one of SIZES
    x: int
    y: int
    radius: int  # half the bounding-box side, pixels
    row: int  # grid cell, 0..2 top -> bottom
    col: int  # grid cell, 0..2 left -> right

    @property
    def location(self) -> str:
        return location_name(self.row, self.col)


@dataclass(frozen=True)
class Scene:
    seed: int
    width: int
    height: int
    background: tuple[int, int, int]
    objects: tuple[SceneObject, ...]  # sorted by grid cell, row-major (reading order)
    object_range: tuple[int, int] = (2, 5)  # generate_scene's (min_objects, max_objects)


@dataclass(frozen=True)
class Seen:
    """What an answer claims about one object. The true view copies the scene."""

    shape: str
    color: str
    size: str
    location: str


@dataclass(frozen=True)
class Fact:
    """One perception fact an answer relies on: object `obj` has `attribute` = `value`."""

    obj: int  # index into scene.objects
    ref: str  # a phrase naming the object in the true scene, e.g. "the red circle at the top left"
    attribute: str  # "color" | "shape" | "size" | "location"
    value: str

    def to_json(self) -> dict[str, object]:
        return {"obj": self.obj, "ref": self.ref, "attribute": self.attribute, "value": self.value}


@dataclass(frozen=True)
class QuestionSpec:
    """What is asked, independent of any view.

    `subjects` are the objects the answer talks about, in the order it mentions them.
    `query` holds the kind's parameters: count -> (("attribute", a), ("value", v));
    existence -> (("color", c), ("shape", s)); spatial -> (("axis", "horizontal"|"vertical"),).
    """

    kind: str
    subjects: tuple[int, ...]
    query: tuple[tuple[str, str], ...] = ()

    def param(self, key: str) -> str:
        return dict(self.query)[key]


@dataclass(frozen=True)
class SceneQA:
    """A question about a scene with its correct, step-by-step grounded answer."""

    scene: Scene
    kind: str
    question: str
    answer: str  # the steps joined, then "Final Answer: <final>" on its own line
    steps: tuple[str, ...]
    final: str
    facts: tuple[Fact, ...]  # the perception facts the steps state
    spec: QuestionSpec


# --------------------------------------------------------------------------- scene generation


def generate_scene(seed: int, image_size: int = 128, min_objects: int = 2, max_objects: int = 5) -> Scene:
    """A random scene, a pure function of its arguments."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE}, got {image_size}")
    if not 1 <= min_objects <= max_objects <= 9:
        raise ValueError(f"need 1 <= min_objects <= max_objects <= 9, got {min_objects}, {max_objects}")
    rng = random.Random(seed)
    n = rng.randint(min_objects, max_objects)
    cells = sorted(rng.sample(range(9), n))
    cell = image_size / 3
    used: set[tuple[str, str]] = set()
    objects = []
    for c in cells:
        row, col = divmod(c, 3)
        shape = rng.choice(SHAPES)
        # Reuse a colour often so that counting questions have answers above 1.
        reuse = [k for k, _ in used if (k, shape) not in used]
        if reuse and rng.random() < 0.4:
            color = rng.choice(sorted(set(reuse)))
        else:
            color = rng.choice([k for k in COLORS if (k, shape) not in used])
        used.add((color, shape))
        size = rng.choice(SIZES)
        r = size_radius(size, image_size)

        def centre(index: int) -> int:
            lo = math.ceil(index * cell + _CELL_GAP + r)
            hi = math.floor((index + 1) * cell - _CELL_GAP - r)
            return rng.randint(lo, hi)

        x, y = centre(col), centre(row)
        objects.append(SceneObject(shape, color, size, x, y, r, row, col))
    return Scene(seed, image_size, image_size, BACKGROUND, tuple(objects), (min_objects, max_objects))


def render(scene: Scene) -> bytes:
    """PNG bytes of the scene. Aliased drawing, so each shape is exactly its palette colour."""
    image = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        fill = PALETTE[o.color]
        box = [o.x - o.radius, o.y - o.radius, o.x + o.radius, o.y + o.radius]
        if o.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif o.shape == "square":
            draw.rectangle(box, fill=fill)
        else:  # apex up, base along the bottom of the box
            draw.polygon(
                [(o.x, o.y - o.radius), (o.x - o.radius, o.y + o.radius), (o.x + o.radius, o.y + o.radius)],
                fill=fill,
            )
    buf = io.BytesIO()
    # Fixed encoder settings and no metadata chunks: same scene -> same bytes.
    image.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def true_view(scene: Scene) -> tuple[Seen, ...]:
    """The view of an answerer that perceives the scene correctly."""
    return tuple(Seen(o.shape, o.color, o.size, o.location) for o in scene.objects)


def object_ref(o: SceneObject | Seen) -> str:
    return f"the {o.color} {o.shape} at the {o.location}"


# --------------------------------------------------------------------------- answer composition


def _plural(spec: QuestionSpec) -> str:
    """The noun phrase counted by a count question: "red shapes", "circles", "large shapes"."""
    attribute, value = spec.param("attribute"), spec.param("value")
    return f"{value}s" if attribute == "shape" else f"{value} shapes"


def matches(spec: QuestionSpec, s: Seen) -> bool:
    """Whether a seen object is one a count or existence question counts."""
    if spec.kind == "count":
        return getattr(s, spec.param("attribute")) == spec.param("value")
    return s.color == spec.param("color") and s.shape == spec.param("shape")


def _listing(spec: QuestionSpec, view: tuple[Seen, ...]) -> list[str]:
    return [f"At the {s.location} there is a {s.size} {s.color} {s.shape}." for s in (view[i] for i in spec.subjects)]


def mentioned_attributes(kind: str) -> tuple[str, ...]:
    """Which attributes of each subject an answer of `kind` states, in the order it states them."""
    return {
        "color": ("size", "shape", "color"),
        "size": ("shape", "color", "size"),
        "spatial": ("size", "location"),
        "count": ("location", "size", "color", "shape"),
        "existence": ("location", "size", "color", "shape"),
    }[kind]


# Derived slots of each kind's answer that `compose_answer` lets a caller override.
OVERRIDE_SLOTS: dict[str, tuple[str, ...]] = {
    "color": ("conclusion_color", "conclusion_size", "conclusion_shape"),
    "size": ("conclusion_color", "conclusion_shape"),
    "spatial": ("comparison", "conclusion_a_size", "conclusion_b_size"),
    "count": ("number",),
    "existence": ("number",),
}


def compose_answer(
    spec: QuestionSpec, view: tuple[Seen, ...], overrides: Mapping[str, str] | None = None
) -> tuple[tuple[str, ...], str]:
    """(steps, final) of the answer an answerer with `view` writes for `spec`.

    `overrides` replaces derived slots (never perception facts) to inject reasoning errors; the
    slots per kind are in OVERRIDE_SLOTS. Only conclusion_color (color) and number (count)
    carry through to the final; the other overrides leave the final as the view implies.
    """
    o = dict(overrides or {})
    k = spec.kind
    if k not in OVERRIDE_SLOTS:
        raise ValueError(f"unknown question kind {k!r}; expected one of {KINDS}")
    unknown = set(o) - set(OVERRIDE_SLOTS[k])
    if unknown:
        raise ValueError(f"unknown override slot(s) {sorted(unknown)} for a {k} answer; known {OVERRIDE_SLOTS[k]}")
    if k in ("color", "size"):
        t = view[spec.subjects[0]]
        loc = spec.param("location")  # the question's own reference; never perturbed
        if k == "color":
            final = o.get("conclusion_color", t.color)
            size, shape = o.get("conclusion_size", t.size), o.get("conclusion_shape", t.shape)
            steps = (
                f"I find the shape at the {loc} of the image.",
                f"It is a {t.size} {t.shape}.",
                f"Its fill is a flat {t.color}.",
                f"So the {size} {shape} at the {loc} is {final}.",
            )
            return steps, final
        final = t.size
        color, shape = o.get("conclusion_color", t.color), o.get("conclusion_shape", t.shape)
        steps = (
            f"I find the shape at the {loc} of the image.",
            f"It is a {t.shape} colored {t.color}.",
            f"Its width is about {SIZE_FRACTION[t.size]} of the image width.",
            f"So the {color} {shape} at the {loc} is {final}.",
        )
        return steps, final
    if k == "spatial":
        ia, ib = spec.subjects
        a, b = view[ia], view[ib]
        name_a, name_b = spec.param("name_a"), spec.param("name_b")
        horizontal = spec.param("axis") == "horizontal"
        ra, ca = location_cell(a.location)
        rb, cb = location_cell(b.location)
        if horizontal:
            relation = "left" if ca < cb else "right"
            comparison = o.get("comparison", relation)
            compare_step = f"The {name_a} is further {comparison} than the {name_b}."
            phrase = f"to the {relation} of"
        else:
            relation = "above" if ra < rb else "below"
            comparison = o.get("comparison", "higher" if relation == "above" else "lower")
            compare_step = f"The {name_a} is {comparison} than the {name_b}."
            phrase = relation
        steps = (
            f"The {name_a} is a {a.size} shape at the {a.location}.",
            f"The {name_b} is a {b.size} shape at the {b.location}.",
            compare_step,
            f"So the {o.get('conclusion_a_size', a.size)} {name_a} is {phrase} the "
            f"{o.get('conclusion_b_size', b.size)} {name_b}.",
        )
        return steps, relation
    if k == "count":
        m = sum(matches(spec, view[i]) for i in spec.subjects)
        number = o.get("number", str(m))
        steps = (
            "I go through the shapes in the image one by one.",
            *_listing(spec, view),
            f"So the number of {_plural(spec)} is {number}.",
        )
        return steps, number
    # existence
    c, s = spec.param("color"), spec.param("shape")
    m = sum(matches(spec, view[i]) for i in spec.subjects)
    verdict = "yes" if m > 0 else "no"
    steps = (
        f"I look for {article(c)} {c} {s} in the image.",
        *_listing(spec, view),
        f"The number of {c} {s}s among them is {o.get('number', str(m))}.",
        f"So the answer is {verdict}.",
    )
    return steps, verdict


def answer_text(steps: tuple[str, ...], final: str) -> str:
    """The released answer format: reasoning, then a "Final Answer:" line."""
    return " ".join(steps) + f"\nFinal Answer: {final}"


# --------------------------------------------------------------------------- questions


def _question(scene: Scene, spec: QuestionSpec) -> str:
    k = spec.kind
    if k == "color":
        return f"What color is the shape at the {spec.param('location')}?"
    if k == "size":
        return f"Is the shape at the {spec.param('location')} {SIZE_QUESTION}?"
    if k == "spatial":
        a, b = spec.param("name_a"), spec.param("name_b")
        if spec.param("axis") == "horizontal":
            return f"Is the {a} to the left or to the right of the {b}?"
        return f"Is the {a} above or below the {b}?"
    if k == "count":
        return f"How many {_plural(spec)} are there in the image?"
    c, s = spec.param("color"), spec.param("shape")
    return f"Is there {article(c)} {c} {s} in the image?"


def _facts(scene: Scene, spec: QuestionSpec) -> tuple[Fact, ...]:
    view = true_view(scene)
    return tuple(
        Fact(i, object_ref(scene.objects[i]), attr, getattr(view[i], attr))
        for i in spec.subjects
        for attr in mentioned_attributes(spec.kind)
    )


def make_qa(scene: Scene, spec: QuestionSpec) -> SceneQA:
    """The correct answer to `spec` about `scene`."""
    steps, final = compose_answer(spec, true_view(scene))
    question, answer = _question(scene, spec), answer_text(steps, final)
    return SceneQA(scene, spec.kind, question, answer, steps, final, _facts(scene, spec), spec)


def _spec(scene: Scene, kind: str, rng: random.Random) -> QuestionSpec:
    objs = scene.objects
    everyone = tuple(range(len(objs)))
    if kind in ("color", "size"):
        t = rng.randrange(len(objs))
        return QuestionSpec(kind, (t,), (("location", objs[t].location),))
    if kind == "spatial":
        if len(objs) < 2:
            raise ValueError(f"a spatial question needs two objects; scene {scene.seed} has {len(objs)}")
        options = [
            (a, b, axis)
            for a in everyone
            for b in everyone
            if a != b
            for axis, differ in (
                ("horizontal", objs[a].col != objs[b].col),
                ("vertical", objs[a].row != objs[b].row),
            )
            if differ
        ]
        a, b, axis = rng.choice(options)
        name_a, name_b = (f"{objs[i].color} {objs[i].shape}" for i in (a, b))
        return QuestionSpec(kind, (a, b), (("axis", axis), ("name_a", name_a), ("name_b", name_b)))
    if kind == "count":
        attribute = rng.choice(("color", "shape", "size"))
        value = getattr(rng.choice(objs), attribute)
        return QuestionSpec(kind, everyone, (("attribute", attribute), ("value", value)))
    if kind == "existence":
        o = rng.choice(objs)
        present = {(p.color, p.shape) for p in objs}
        if rng.random() < 0.5:
            query = (o.color, o.shape)
        else:
            # A near miss (one attribute off from a real object), so the image has to be read.
            misses = [(c, o.shape) for c in COLORS] + [(o.color, s) for s in SHAPES]
            query = rng.choice([q for q in misses if q not in present])
        return QuestionSpec(kind, everyone, (("color", query[0]), ("shape", query[1])))
    raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")


# --------------------------------------------------------------------------- content split

# Scene content is split, not only seeds: one-object scenes have a few hundred set-ups, so
# another seed mostly repeats a training image. An object whose (shape, grid cell) pair is one
# of the held-out combinations below never appears in training data (the base judge's, or a
# GRPO run's by default); evaluation scenes hold at least one. One shape per cell, each shape
# in three cells (a Latin square): training still sees every shape, colour, size and cell.


def held_out_object(o: SceneObject) -> bool:
    """Whether the object's (shape, cell) combination is reserved for evaluation."""
    return (o.row + o.col + SHAPES.index(o.shape)) % 3 == 0


def scene_split(scene: Scene) -> str:
    """ "held_out" if any object is a held-out combination, else "train"."""
    return "held_out" if any(held_out_object(o) for o in scene.objects) else "train"


def in_split(scene: Scene, split: str) -> bool:
    if split not in SPLITS:
        raise ValueError(f"unknown scene split {split!r}; expected one of {SPLITS}")
    return split == "all" or scene_split(scene) == split


def split_qas(
    n: int, seed_of: Callable[[int], int], split: str, image_size: int, kinds: Sequence[str], objects: Sequence[int]
) -> list[SceneQA]:
    """`n` questions whose scenes lie in `split`: question i asks `kinds[i % len(kinds)]` about
    the next scene seed `seed_of(0), seed_of(1), ...` whose scene is in the split."""
    out: list[SceneQA] = []
    j = 0
    while len(out) < n:
        qa = sample_qa(seed_of(j), image_size, kinds[len(out) % len(kinds)], *objects)
        j += 1
        if in_split(qa.scene, split):
            out.append(qa)
    return out


def scene_ref(qa: SceneQA) -> dict[str, object]:
    """What regenerates `qa` (`qa_from_ref`): its scene seed, image size, object range and kind."""
    s = qa.scene
    return {"seed": s.seed, "image_size": s.width, "objects": list(s.object_range), "kind": qa.kind}


def _object_range(ref: Mapping[str, object]) -> tuple[int, int]:
    # References without "objects" predate object ranges and used the default 2-5.
    low, high = ref.get("objects", (2, 5))  # type: ignore[misc]
    return int(low), int(high)


def scene_from_ref(ref: Mapping[str, object]) -> Scene:
    """The scene of a `scene_ref` (its "kind" is not needed)."""
    return generate_scene(int(ref["seed"]), int(ref["image_size"]), *_object_range(ref))  # type: ignore[arg-type]


def qa_from_ref(ref: Mapping[str, object]) -> SceneQA:
    """The question and scene of a `scene_ref`."""
    return sample_qa(int(ref["seed"]), int(ref["image_size"]), str(ref["kind"]), *_object_range(ref))  # type: ignore[arg-type]


def scene_questions(scene: Scene, rng: random.Random) -> list[SceneQA]:
    """One question of each kind in KINDS (in that order) about `scene`, with correct answers."""
    return [make_qa(scene, _spec(scene, kind, rng)) for kind in KINDS]


def sample_qa(
    seed: int, image_size: int = 128, kind: str | None = None, min_objects: int = 2, max_objects: int = 5
) -> SceneQA:
    """A scene and one question about it, a pure function of the arguments (kind drawn if None)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")
    scene = generate_scene(seed, image_size, min_objects, max_objects)
    rng = random.Random(f"pjray.scenes.qa:{seed}")  # str seeds hash stably across runs
    chosen = kind if kind is not None else rng.choice(KINDS)
    return make_qa(scene, _spec(scene, chosen, rng))
