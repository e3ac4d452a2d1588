"""Final-answer checks, probes, perceptual hashes and decontamination."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image, ImageDraw

from pjray.ppjd.verify import (
    ProbeRecord,
    dhash,
    final_check,
    hamming,
    load_eval_index,
    normalize_question,
    oracle_answer,
    phash,
    settle,
    span_changes,
)


def png(draw_fn, size=(96, 96)) -> bytes:
    img = Image.new("RGB", size, (255, 255, 255))
    draw_fn(ImageDraw.Draw(img))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


CIRCLE = png(lambda d: d.ellipse([10, 10, 50, 50], fill=(200, 20, 20)))
SQUARES = png(
    lambda d: (d.rectangle([50, 40, 90, 90], fill=(20, 20, 200)), d.rectangle([0, 0, 20, 30], fill=(0, 0, 0)))
)


def test_final_check_wants_a_readable_wrong_final():
    chosen = "Steps.\nFinal Answer: two"
    assert final_check([chosen, "x\nFinal Answer: 3", "y \\boxed{4}"], "2") == []
    problems = final_check([chosen, "x\nFinal Answer: Two.", "no final here"], "2")
    assert "equals the ground truth" in problems[0] and "no final answer" in problems[1]


def test_span_changes_finds_short_replacements_only():
    a = "The ball is red. There are 2 cats. A long sentence about nothing in particular at all here."
    b = "The ball is blue. There are 3 cats. Something else entirely different was written by the model now."
    assert span_changes(a, b)[:2] == [("red", "blue"), ("2", "3")]
    assert all(len(o.split()) <= 8 for o, _ in span_changes(a, b))
    assert span_changes(a, a) == []


def test_settle_needs_the_original_and_not_the_perturbed():
    p = ProbeRecord(1, "q", "red", "blue")
    assert settle(p, "Red.").consistent
    assert not settle(p, "blue").consistent
    assert not settle(p, "red or blue").consistent
    assert not settle(p, "reddish").consistent  # whole words only
    assert settle(ProbeRecord(1, "q", "2", "3"), "two").consistent  # numbers normalise


def test_oracle_answers_structured_and_span_probes():
    from pjray.data.scenes import generate_scene

    ref = {"seed": 11, "image_size": 96}
    scene = generate_scene(11, 96)
    present = {o.color for o in scene.objects}
    absent = next(c for c in ("red", "green", "blue", "yellow", "purple", "orange") if c not in present)
    real = sorted(present)[0]
    assert oracle_answer(ref, ProbeRecord(1, "q", real, absent), None) == real
    assert oracle_answer(ref, ProbeRecord(1, "q", absent, real), None) == real
    assert oracle_answer(ref, ProbeRecord(1, "q", "cat", "dog"), None) == "cannot tell"
    assert oracle_answer(ref, ProbeRecord(1, "q", "a", "b"), {"value": "a"}) == "a"


def test_hashes_are_stable_close_under_resize_and_far_apart_otherwise():
    assert dhash(CIRCLE) == dhash(CIRCLE) and phash(CIRCLE) == phash(CIRCLE)
    big = Image.open(io.BytesIO(CIRCLE)).resize((300, 300))
    buf = io.BytesIO()
    big.convert("RGB").save(buf, format="JPEG", quality=80)
    assert hamming(dhash(CIRCLE), dhash(buf.getvalue())) <= 4
    assert hamming(phash(CIRCLE), phash(buf.getvalue())) <= 4
    assert hamming(dhash(CIRCLE), dhash(SQUARES)) > 10
    assert hamming(phash(CIRCLE), phash(SQUARES)) > 10
    assert 0 <= dhash(CIRCLE) < 2**64 and 0 <= phash(CIRCLE) < 2**64


def test_eval_index_matches_images_and_questions(tmp_path):
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "1.png").write_bytes(CIRCLE)
    bench = tmp_path / "batch.jsonl"
    bench.write_text(
        json.dumps({"id": 1, "image_path": "image/1.png", "instruction": "What is <image> SHOWN here?"}) + "\n"
    )
    bias = tmp_path / "bias.json"
    bias.write_text(json.dumps([{"unbiased_instruction": "Count the cats.", "biased_instruction": ""}]))
    index = load_eval_index([str(bench), str(bias)])
    assert len(index.hashes) == 1
    assert "image matches" in index.match(CIRCLE, "another question", 4)
    assert "question matches" in index.match(SQUARES, "count the cats", 4)
    assert index.match(SQUARES, "Count the dogs.", 4) is None
    assert normalize_question("What is <image> SHOWN here?") == "what is shown here"


def test_eval_index_errors_name_the_file(tmp_path):
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"image_path": "nope.png", "instruction": "q"}) + "\n")
    with pytest.raises(FileNotFoundError, match="b.jsonl"):
        load_eval_index([str(bench)])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_eval_index([str(tmp_path / "missing.jsonl")])
