"""PPJD sources: MMPR-v1.2 meta.json + JSONL, generic JSONL/parquet, scenes; and pure stages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pjray.ppjd.perturb import perception_problems, reasoning_problems, scene_items
from pjray.ppjd.pipeline import (
    _frame,
    check_finals,
    each_live_row,
    load_row,
    perturb_rules,
    to_item,
    vqa_oracle,
)
from pjray.ppjd.sources import ANSWER_KEYS, file_rows, mmpr_rows, read_source, scene_rows
from support.ppjd import only_attribute_words_differ

def test_mmpr_meta_and_answer_field_names(tmp_path):
    root = tmp_path / "images" / "geo"
    root.mkdir(parents=True)
    lines = [json.dumps({"image": "a.png", "question": "q0", "chosen": "c", "rejected": "r", key: f"v-{key}"})
             for key in ANSWER_KEYS]
    lines.insert(2, "{not json")
    lines.append(json.dumps({"image": "b.png", "chosen": "c"}))  # no question, no answer
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "geo_correctness_rules.jsonl").write_text("\n".join(lines) + "\n")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"geo": {"root": "images/geo", "annotation": "ann/geo_correctness_rules.jsonl",
                                        "data_augment": False, "repeat_time": 1, "length": 7}}))
    rows = mmpr_rows(meta)
    assert len(rows) == len(ANSWER_KEYS) + 2  # every line is a row, the broken one too
    good = [r for r in rows if not r.reject_stage]
    assert [r.answer for r in good[: len(ANSWER_KEYS)]] == [f"v-{k}" for k in ANSWER_KEYS]
    assert good[0].image_path == str((root / "a.png").resolve())
    broken = [r for r in rows if r.reject_stage]
    assert len(broken) == 1 and "line 3" in broken[0].reject_reason and "not JSON" in broken[0].reject_reason
    assert good[-1].question == "" and good[-1].answer == ""
    assert len({r.id for r in rows}) == len(rows)


def test_mmpr_meta_errors_name_the_entry(tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"geo": {"root": "x"}}))
    with pytest.raises(ValueError, match="'geo' has no 'annotation'"):
        mmpr_rows(meta)


def test_generic_parquet_with_bytes_and_jsonl_with_paths(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"image": b"\x89PNG", "question": "q", "response": "c", "gt": "1"}]),
                   tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text(json.dumps({"image_path": "x.png", "question": "q", "chosen": "c"}) + "\n")
    rows = file_rows([tmp_path / "d.parquet", tmp_path / "d.jsonl"], "jsonl")
    assert rows[0].image == b"\x89PNG" and rows[0].chosen == "c" and rows[0].answer == "1"
    assert rows[1].image_path == str(tmp_path / "x.png")


def test_load_stage_rejects_missing_and_corrupt(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    raw = [r.to_dict() for r in read_source("scenes", [], 1, 0, 96)]
    raw[0]["scene"] = ""
    raw[0]["image_path"] = str(tmp_path / "bad.png")
    assert "corrupt image" in load_row(dict(raw[0]))
    raw[0]["image_path"] = str(tmp_path / "gone.png")
    assert "not found" in load_row(dict(raw[0]))
    raw[0]["image_path"], raw[0]["question"] = "", ""
    assert load_row(dict(raw[0])) == "missing field(s): question, image"


def test_each_live_row_turns_exceptions_into_rejects():
    rows = [{"reject_stage": "", "reject_reason": "", "x": x} for x in (1, 0, 2)]
    rows.append({"reject_stage": "load", "reject_reason": "earlier", "x": 0})
    each_live_row("perturb", lambda r: None if 1 / r["x"] else "never")(rows)
    assert [r["reject_stage"] for r in rows] == ["", "perturb", "", "load"]
    assert "ZeroDivisionError" in rows[1]["reject_reason"] and rows[3]["reject_reason"] == "earlier"


@pytest.mark.parametrize("k", [3, 5])
def test_rules_levels_on_scenes_are_verifiably_wrong_and_ordered(k):
    frame = _frame(0, scene_rows(20, seed=3, image_size=96))
    for row in frame.to_dict("records"):
        assert load_row(row) is None and perturb_rules(row, k) is None
        assert check_finals(row) is None and vqa_oracle(row) is None
        from pjray.ppjd.pipeline import _scene_qa

        qa = _scene_qa(row)
        texts = [lv["text"] for lv in json.loads(row["levels"])]
        assert texts[0] == qa.answer and perception_problems(qa, texts[0]) == []
        # Perception-only: wrong about the image, coherent reasoning, attribute words changed only.
        assert perception_problems(qa, texts[1]) and reasoning_problems(qa, texts[1]) == []
        assert only_attribute_words_differ(texts[0], texts[1])
        assert not only_attribute_words_differ(texts[0], texts[0].replace(" the ", " one ", 1))
        # Perception + reasoning: also fails the reasoning check.
        assert reasoning_problems(qa, texts[2])
        records = [lv["record"] for lv in json.loads(row["levels"])]
        counts = [r["perception_errors"] + r["reasoning_errors"] for r in records]
        assert counts == sorted(counts) and len(set(counts)) == k
        item = to_item(row, k)
        assert [item.candidates[i] for i in item.order] == texts


def test_pipeline_rows_match_the_in_process_builder():
    rows = scene_rows(5, seed=0, image_size=96)
    items = scene_items(5, seed=0, num_candidates=3, image_size=96)
    assert [r.id for r in rows] == [it.id for it in items]
    for r, it in zip(_frame(0, rows).to_dict("records"), items):
        perturb_rules(r, 3)
        assert [lv["text"] for lv in json.loads(r["levels"])] == [it.candidates[i] for i in it.order]
