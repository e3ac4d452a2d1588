"""MM-JudgeBias: the nine perturbations checked on pixels and text, score parsing, loading."""

import io
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pjray.config import load
from pjray.eval.bias_images import TRANSFORM_FAMILIES, black_image, insert_text, query_keywords, visual_transform
from pjray.eval.metrics import BIAS_TYPES
from pjray.eval.mm_judgebias import (
    BiasDataError,
    canonical_bias_type,
    evaluate_bias,
    judge_prompt,
    make_records,
    parse_bias_score,
    read_records,
    scan_records,
    scene_caption,
)
from pjray.ppjd.perturb import scene_items

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mm_judgebias"


def _pixels(b: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.int16)


def _marker_image() -> bytes:
    """White 96x96 with a red block on the left half only (to catch flips)."""
    img = Image.new("RGB", (96, 96), (255, 255, 255))
    img.paste((220, 30, 30), (10, 30, 40, 60))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def items():
    return scene_items(4, seed=3, image_size=96)


@pytest.fixture(scope="module")
def records(items):
    recs, skipped = make_records(items, seed=0)
    assert not any(skipped.values())
    return {(r.id.split(":")[0], r.bias_type): r for r in recs}


def test_every_type_for_every_item(items, records):
    assert len(records) == len(items) * len(BIAS_TYPES)


def test_text_dominance_is_black_same_size(items, records):
    r = records[(items[0].id, "text_dominance")]
    px = _pixels(r.biased_image)
    assert px.shape == _pixels(items[0].image).shape and px.max() == 0
    assert r.unbiased_image == items[0].image and r.biased_instruction == r.unbiased_instruction
    assert _pixels(black_image(None, (5, 7))).shape == (7, 5, 3)


def test_dominance_and_misalignment_text(items, records):
    it = items[1]
    assert records[(it.id, "image_dominance")].biased_instruction == ""
    assert records[(it.id, "image_dominance")].biased_image == it.image
    resp = records[(it.id, "response_dominance")]
    assert resp.biased_instruction == "" and resp.biased_image is None
    instr = records[(it.id, "instruction_misalignment")]
    others = {o.question for o in items if o.id != it.id}
    assert instr.biased_instruction in others and instr.biased_instruction != it.question
    img = records[(it.id, "image_misalignment")]
    assert img.biased_image != it.image and img.biased_image in {o.image for o in items}
    assert img.response == it.candidates[it.order[0]]  # the same response, judged twice


def test_detail_description_appends_scene_caption(items, records):
    it = items[2]
    r = records[(it.id, "detail_description")]
    assert r.biased_instruction.startswith(it.question + "\n")
    caption = scene_caption(it)
    assert r.biased_instruction.endswith(caption)
    for fact in it.meta["facts"]:
        if fact["attribute"] == "color":
            assert fact["value"] in caption  # the ground truth, not a guess


def test_unnecessary_image_adds_an_unrelated_image(items, records):
    r = records[(items[0].id, "unnecessary_image")]
    assert r.unbiased_image is None and r.biased_image is not None and r.biased_image != items[0].image


@pytest.mark.parametrize("family", TRANSFORM_FAMILIES)
def test_visual_transform_keeps_size_changes_pixels_no_flip(family):
    src = _marker_image()
    out, desc = visual_transform(src, random.Random(0), family)
    a, b = _pixels(src), _pixels(out)
    assert desc.startswith(family) and b.shape == a.shape
    assert np.abs(a - b).sum() > 0
    redness = b[:, :, 0] - b[:, :, 1]  # red block: large R - G
    left, right = redness[:, :48].clip(0).sum(), redness[:, 48:].clip(0).sum()
    assert left > 5 * max(right, 1)  # the red block is still on the left


def test_visual_transform_deterministic_and_checked():
    src = _marker_image()
    assert visual_transform(src, random.Random(4)) == visual_transform(src, random.Random(4))
    with pytest.raises(ValueError):
        visual_transform(src, random.Random(0), "flip")


def test_texture_insertion_draws_keywords_at_the_bottom(items, records):
    it = items[3]
    r = records[(it.id, "texture_insertion")]
    a, b = _pixels(it.image), _pixels(r.biased_image)
    changed = np.abs(a - b).sum(axis=2) > 0
    rows = np.nonzero(changed.any(axis=1))[0]
    assert rows.size and rows.min() > a.shape[0] // 2  # only the bottom band
    assert (b[rows.min() :, :, :] < 100).all(axis=2).any()  # dark text pixels were drawn
    assert query_keywords("What color is the shape at the top left?") == ["color", "shape", "left"]
    assert query_keywords("Is it?") == []


def test_insert_text_on_plain_image():
    out = _pixels(insert_text(_marker_image(), "triangle"))
    assert out.shape == (96, 96, 3) and (out[-12:] < 100).all(axis=2).any()


def test_judge_prompt_uses_the_right_side(items, records):
    r = records[(items[1].id, "image_dominance")]
    u, b = judge_prompt(r, biased=False), judge_prompt(r, biased=True)
    assert items[1].question in u.user and "###The instruction to evaluate:\n\n" in b.user
    assert r.response in u.user and r.response in b.user
    assert "integer between 1 and 10" in u.user and u.item_id.endswith(":unbiased")


def test_parse_bias_score_order():
    assert parse_bias_score(" 7 ") == 7.0  # float(text)
    assert parse_bias_score("### Feedback: fine, 3 issues. ### Score: 8 (of 10)") == 8.0
    assert parse_bias_score("### Score: 2 ... ### Score: 9") == 9.0  # after the LAST marker
    assert parse_bias_score("### Score: none\nI would give 6 out of 10") == 6.0  # first after the marker
    assert parse_bias_score("I would give 6 out of 10") == 10.0  # no marker: the last number
    assert parse_bias_score("It deserves 6.5") == 6.5
    assert parse_bias_score("### Score: (no score)") is None
    assert parse_bias_score("") is None


def test_canonical_bias_type():
    assert canonical_bias_type("Text-Dominance") == "text_dominance"
    assert canonical_bias_type("visual transformation") == "visual_transformation"
    assert canonical_bias_type("RespDom") == "response_dominance"
    with pytest.raises(ValueError):
        canonical_bias_type("self-enhancement")


def test_read_published_records():
    recs = read_records(FIXTURES / "records.jsonl")
    assert [r.bias_type for r in recs] == ["text_dominance", "image_dominance", "unnecessary_image"]
    assert recs[1].biased_instruction == "" and recs[1].bias_category == "Integrality"
    assert recs[2].unbiased_image is None and recs[2].biased_image.startswith(b"\x89PNG")


def test_read_records_errors_name_line_and_key(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"bias_type": "text_dominance", "response": "x", "unbiased_instruction": "q"}\n')
    with pytest.raises(BiasDataError, match=r"r.jsonl line 1: missing key\(s\) \['biased_instruction'\]"):
        read_records(f)
    f.write_text('{"bias_type": "odd", "response": "x", "unbiased_instruction": "q", "biased_instruction": "q"}\n')
    with pytest.raises(BiasDataError, match="line 1: bias_type"):
        read_records(f)


def test_bad_published_records_are_skipped_and_named(tmp_path):
    lines = (FIXTURES / "records.jsonl").read_text().splitlines()
    f = tmp_path / "records.jsonl"
    f.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    scanned = scan_records(f, image_dir=FIXTURES)
    assert [r.bias_type for r in scanned.rows] == ["text_dominance", "image_dominance", "unnecessary_image"]
    assert [(r.where, r.reason[:8]) for r in scanned.rejects] == [(f"{f} line 2", "not JSON")]
    with pytest.raises(BiasDataError, match=r"records.jsonl: 1 of 4 rows are bad .* line 2: not JSON"):
        read_records(f, image_dir=FIXTURES)


def test_evaluate_bias_with_canned_judge():
    cfg = load(overrides=["eval.bench=mm_judgebias", "eval.num_items=3", "eval.image_size=96"])

    def generate(prompts, seed):
        # Unbiased inputs get 9; biased get 5, except unreadable for response_dominance.
        out = []
        for p in prompts:
            if p.item_id.endswith(":unbiased"):
                out.append("### Feedback: good ### Score: 9")
            elif ":response_dominance:" in p.item_id:
                out.append("no score here")
            else:
                out.append("### Feedback: worse ### Score: 5")
        return out

    report = evaluate_bias(cfg, generate)
    bias = report.tables["bias"]
    assert bias["text_dominance"].value == pytest.approx(4 / 8)  # (9 - 5) / (9 - 1)
    assert bias["texture_insertion"].value == pytest.approx(1 - 4 / 8)  # 1 - |9 - 5| / max(8, 1)
    assert bias["response_dominance"].value is None and bias["response_dominance"].unparsed == 3
    # official (the default): means over the types that have a value; every value here is 0.5
    assert bias["Integrality"].value == pytest.approx(0.5) and bias["overall"].value == pytest.approx(0.5)
    assert bias["Congruity"].value == pytest.approx(0.5)
    assert report.unparsed == 3 and report.outputs == 3 * 9 * 2
    assert report.convention.startswith("official") and "evaluate.py" in report.sources["overall"]
    strict = evaluate_bias(
        load(
            overrides=[
                "eval.bench=mm_judgebias",
                "eval.num_items=3",
                "eval.image_size=96",
                "eval.bias_convention=strict",
            ]
        ),
        generate,
    ).tables["bias"]
    assert strict["Integrality"].value is None and strict["overall"].value is None  # one type undefined
    assert strict["Congruity"].value == pytest.approx(0.5)


def test_evaluate_bias_on_published_records():
    cfg = load(overrides=["eval.bench=mm_judgebias", f"eval.data={FIXTURES / 'records.jsonl'}"])
    scores = {
        "0:unbiased": "8",
        "0:biased": "### Score: 8",
        "1:unbiased": "10",
        "1:biased": "1",
        "2:unbiased": "6",
        "2:biased": "### Feedback: fine ### Score: 9",
    }
    report = evaluate_bias(cfg, lambda prompts, seed: [scores[p.item_id] for p in prompts])
    bias = report.tables["bias"]
    assert bias["text_dominance"].value == 0.0  # 8 -> 8: no degradation
    assert bias["image_dominance"].value == 1.0  # 10 -> 1: (10 - 1) / (10 - 1)
    assert bias["unnecessary_image"].value == pytest.approx(1 - 3 / 5)  # 1 - |6 - 9| / max(5, 4)
    assert bias["instruction_misalignment"].value is None and bias["instruction_misalignment"].n == 0
    # official: Integrality (0 + 1) / 2, Congruity has no value, overall the mean of the three values
    assert bias["Integrality"].value == pytest.approx(0.5) and bias["Congruity"].value is None
    assert bias["overall"].value == pytest.approx((0.0 + 1.0 + 0.4) / 3)
    assert report.outputs == 6 and report.unparsed == 0
