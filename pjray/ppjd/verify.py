"""Checks of the PPJD job: final answers, VQA consistency of perturbations, decontamination.

- `final_check`: every rejected candidate's final answer must differ from the ground truth after
  normalisation (otherwise a "wrong" candidate is in fact right and the ranking target lies).
- VQA consistency: each altered attribute becomes a probe question about the image. A
  perturbation is kept only if the image's answer agrees with the original attribute and
  contradicts the perturbed one. Two answerers: `oracle_answer` (the scene's ground-truth
  facts) and `VlmProber` (a VLM judge engine answers from the image).
- Decontamination: a 64-bit perceptual hash (dHash and a DCT pHash, both with PIL + numpy) of
  every image, and the normalised question, against the evaluation sets named in the config.
"""

from __future__ import annotations

import difflib
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pjray.data.scenes import COLORS, LOCATIONS, SHAPES, SIZES, scene_from_ref
from pjray.ppjd.perturb import final_answer, normalize_answer

# --------------------------------------------------------------------------- final answers


def final_check(candidates: Sequence[str], truth: str) -> list[str]:
    """Problems with the rejected candidates (levels 1..), [] if each final is readable and wrong."""
    problems = []
    for level, text in enumerate(candidates[1:], start=1):
        final = final_answer(text)
        if final is None:
            problems.append(f"level {level}: no final answer (\\boxed{{}} or 'Final Answer:')")
        elif normalize_answer(final) == normalize_answer(truth):
            problems.append(f"level {level}: final answer {final!r} equals the ground truth")
    return problems


# --------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class ProbeRecord:
    """One probe about an altered attribute, with the image's answer and the verdict."""

    level: int  # candidate level (1 = perception only, ...)
    question: str
    original: str  # what the chosen answer says
    perturbed: str  # what the candidate says instead
    answer: str = ""  # the image's answer (oracle or VLM)
    consistent: bool = False  # answer agrees with `original` and contradicts `perturbed`

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def span_changes(chosen: str, candidate: str, max_words: int = 8) -> list[tuple[str, str]]:
    """Word spans replaced between two texts: [(original, perturbed)], for free-form rewrites.

    Long replaced spans (rewritten sentences) are not attribute edits and are skipped: a probe
    about half a sentence is not a question an image can settle.
    """
    a, b = chosen.split(), candidate.split()
    changes = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "replace" and i2 - i1 <= max_words and j2 - j1 <= max_words:
            original, perturbed = (" ".join(w).strip(".,;:!?") for w in (a[i1:i2], b[j1:j2]))
            if original and perturbed and original.lower() != perturbed.lower():
                changes.append((original, perturbed))
    return changes


def span_probe(level: int, original: str, perturbed: str) -> ProbeRecord:
    question = f"Look at the image. Which is correct: '{original}' or '{perturbed}'? Answer with one of them."
    return ProbeRecord(level, question, original, perturbed)


def settle(probe: ProbeRecord, answer: str) -> ProbeRecord:
    """The probe with the image's answer and whether it supports the original only."""
    said = normalize_answer(answer)
    has = lambda s: bool(s) and re.search(rf"(^| ){re.escape(normalize_answer(s))}( |$)", said) is not None  # noqa: E731
    consistent = has(probe.original) and not has(probe.perturbed)
    return ProbeRecord(probe.level, probe.question, probe.original, probe.perturbed, answer, consistent)


_LEXICON = {w for group in (COLORS, SHAPES, SIZES) for w in group} | {w for loc in LOCATIONS for w in loc.split()}


def oracle_answer(scene_ref: dict[str, Any], probe: ProbeRecord, truth: dict[str, str] | None) -> str:
    """What the scene says about a probe.

    Structured probes (rules backend) carry the true attribute value in `truth`; free-form span
    probes (llm backend) are settled from the scene's lexicon: the original is supported when
    each attribute word it uses names something in the scene, and the perturbed side when it does.
    """
    if truth is not None:
        return truth["value"]
    scene = scene_from_ref(scene_ref)
    present = {w for o in scene.objects for v in (o.color, o.shape, o.size, o.location) for w in v.split()}

    def supported(span: str) -> bool:
        words = {w for w in normalize_answer(span).split() if w in _LEXICON}
        return bool(words) and words <= present

    if supported(probe.original) and not supported(probe.perturbed):
        return probe.original
    if supported(probe.perturbed) and not supported(probe.original):
        return probe.perturbed
    return "cannot tell"


class VlmProber:
    """Answers probe questions from the image with a VLM judge (a `RolloutEngine`, greedy-ish).

    Built inside a pipeline actor; `engine` is any object with the RolloutEngine `generate`.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def answer(self, questions: list[tuple[bytes, str]], seed: int = 0) -> list[str]:
        from pjray.types import JudgePrompt

        prompts = [
            JudgePrompt(
                item_id=str(i),
                system="Answer the question about the image briefly.",
                user=q,
                image=img,
                protocol="score",
                style="ranking",
                num_candidates=1,
                shown=(0,),
                target="",
            )
            for i, (img, q) in enumerate(questions)
        ]
        if not prompts:
            return []
        completions = self.engine.generate(prompts, 1, seed)
        return [c.text for c in sorted(completions, key=lambda c: c.prompt_index)]


# --------------------------------------------------------------------------- perceptual hashes


def _gray(image: bytes | Image.Image, size: tuple[int, int]) -> np.ndarray:
    img = Image.open(io.BytesIO(image)) if isinstance(image, (bytes, bytearray)) else image
    return np.asarray(img.convert("L").resize(size, Image.Resampling.LANCZOS), dtype=np.float64)


def _bits_to_int(bits: np.ndarray) -> int:
    return int("".join("1" if b else "0" for b in bits.ravel()), 2)


def dhash(image: bytes | Image.Image, side: int = 8) -> int:
    """Difference hash: side*side bits, 1 where a pixel is brighter than its right neighbour."""
    px = _gray(image, (side + 1, side))
    return _bits_to_int(px[:, 1:] > px[:, :-1])


def _dct_matrix(n: int) -> np.ndarray:
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2 / n)
    m[0] /= np.sqrt(2)
    return m


def phash(image: bytes | Image.Image, side: int = 8, scale: int = 4) -> int:
    """DCT hash: the low side x side DCT coefficients of a 32x32 grey image against their median."""
    n = side * scale
    d = _dct_matrix(n)
    coeffs = (d @ _gray(image, (n, n)) @ d.T)[:side, :side]
    flat = coeffs.ravel()[1:]  # the DC term only says how bright the image is
    return _bits_to_int(np.concatenate([[False], flat > np.median(flat)]))


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def normalize_question(q: str) -> str:
    """Lowercase words without punctuation or an image placeholder, for exact matching."""
    q = q.replace("<image>", " ").lower()
    return " ".join(re.sub(r"[^\w\s]", " ", q).split())


@dataclass(frozen=True)
class EvalIndex:
    """Hashes and normalised questions of the evaluation sets to keep out of PPJD."""

    hashes: tuple[tuple[int, int], ...]  # (dhash, phash) per evaluation image
    questions: frozenset[str]

    def match(self, image: bytes, question: str, max_distance: int) -> str | None:
        """Why this row collides with an evaluation item, or None."""
        q = normalize_question(question)
        if q and q in self.questions:
            return f"question matches an evaluation question: {q[:60]!r}"
        if self.hashes:
            d, p = dhash(image), phash(image)
            for ed, ep in self.hashes:
                if hamming(d, ed) <= max_distance and hamming(p, ep) <= max_distance:
                    return f"image matches an evaluation image (dhash/phash distance {hamming(d, ed)}/{hamming(p, ep)})"
        return None


_QUESTION_KEYS = ("instruction", "question", "query", "unbiased_instruction", "biased_instruction", "Text")
_IMAGE_KEYS = ("image_path", "image", "unbiased_image", "biased_image", "Image")


def _records(path: Path) -> Iterable[dict[str, Any]]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        yield from (data if isinstance(data, list) else [data])
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {n}: not JSON ({err.msg})") from None


def load_eval_index(files: Sequence[str]) -> EvalIndex:
    """Read evaluation JSON/JSONL files (MLLM-as-a-Judge, MM-JudgeBias layouts).

    Question fields: instruction / question / query / (un)biased_instruction / Text. Image fields
    hold a path relative to the file's folder (or absolute); missing image files are errors,
    because a silently skipped image is a silently leaked one.
    """
    hashes: list[tuple[int, int]] = []
    questions: set[str] = set()
    seen_paths: set[Path] = set()
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"ppjd.decontam_files: {path} does not exist")
        for record in _records(path):
            for key in _QUESTION_KEYS:
                if isinstance(record.get(key), str) and record[key].strip():
                    questions.add(normalize_question(record[key]))
            for key in _IMAGE_KEYS:
                value = record.get(key)
                if not isinstance(value, str) or not value:
                    continue
                image_path = (path.parent / value).resolve()
                if image_path in seen_paths:
                    continue
                if not image_path.is_file():
                    raise FileNotFoundError(f"{path}: {key}={value!r} -> {image_path} does not exist")
                seen_paths.add(image_path)
                data = image_path.read_bytes()
                hashes.append((dhash(data), phash(data)))
    return EvalIndex(tuple(hashes), frozenset(questions))
