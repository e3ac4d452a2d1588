"""PPJD sources: MMPR-v1.2 meta.json + JSONL, generic JSONL/parquet, scenes; and pure stages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.ppjd import only_attribute_words_differ

from pjray.ppjd.perturb import scene_items
from pjray.ppjd.pipeline import ShardWriter, _frame
from pjray.ppjd.rejects import RejectRateError, RowDataError
from pjray.ppjd.scene_checks import perception_problems, reasoning_problems
from pjray.ppjd.sources import ANSWER_KEYS, file_rows, mmpr_rows, read_source, scene_rows
from pjray.ppjd.stages import (
    MIN_ROWS_CHECKED,
    check_finals,
    each_live_row,
    load_row,
    perturb_rules,
    to_item,
    vqa_oracle,
)


def test_mmpr_meta_and_answer_field_names(tmp_path):
    root = tmp_path / "images" / "geo"
    root.mkdir(parents=True)
    lines = [
        json.dumps({"image": "a.png", "question": "q0", "chosen": "c", "rejected": "r", key: f"v-{key}"})
        for key in ANSWER_KEYS
    ]
    lines.insert(2, "{not json")
    lines.append(json.dumps({"image": "b.png", "chosen": "c"}))  # no question, no answer
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "geo_correctness_rules.jsonl").write_text("\n".join(lines) + "\n")
    meta = tmp_path / "meta.json"
    meta.write_text(
        json.dumps(
            {
                "geo": {
                    "root": "images/geo",
                    "annotation": "ann/geo_correctness_rules.jsonl",
                    "data_augment": False,
                    "repeat_time": 1,
                    "length": 7,
                }
            }
        )
    )
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
    pq.write_table(
        pa.Table.from_pylist([{"image": b"\x89PNG", "question": "q", "response": "c", "gt": "1"}]),
        tmp_path / "d.parquet",
    )
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


def test_each_live_row_rejects_data_errors_and_lets_bugs_fail():
    def fn(row):
        if row["x"] < 0:
            raise RowDataError(f"negative x {row['x']}")
        return "zero" if row["x"] == 0 else None

    rows = [{"reject_stage": "", "reject_reason": "", "x": x} for x in (1, -1, 0)]
    rows.append({"reject_stage": "load", "reject_reason": "earlier", "x": -5})
    each_live_row("perturb", fn)(rows)
    assert [(r["reject_stage"], r["reject_reason"]) for r in rows] == [
        ("", ""),
        ("perturb", "negative x -1"),
        ("perturb", "zero"),
        ("load", "earlier"),
    ]
    # A bug in a stage (here a KeyError) is no reject reason: it fails the job.
    with pytest.raises(KeyError):
        each_live_row("perturb", lambda r: r["no such field"])([{"reject_stage": "", "reject_reason": ""}])


def _work_rows(n: int, rejected: dict[str, int]) -> list[dict]:
    """n scene work rows at the write stage: the first ones rejected at the given stages, the
    rest through the rules stages."""
    rows = _frame(0, scene_rows(n, seed=0, image_size=96)).to_dict("records")
    stages = [stage for stage, count in rejected.items() for _ in range(count)]
    for row, stage in zip(rows, stages):
        row["reject_stage"], row["reject_reason"] = stage, f"bad {stage}"
    for row in rows[len(stages) :]:
        assert load_row(row) is None and perturb_rules(row, 3) is None and vqa_oracle(row) is None
    return rows


def test_shard_writer_fails_when_a_stage_rejects_nearly_everything(tmp_path):
    writer = ShardWriter(str(tmp_path), 3, max_reject_fraction=0.9)
    rows = _work_rows(12, {"load": 11})
    with pytest.raises(RejectRateError, match=r"shard-00007: stage 'load' rejected 11 of the 12 rows") as err:
        writer.write_shard(7, rows)
    assert "11 x 'bad load'" in str(err.value)
    # The shard's rejects are written for the diagnosis, its PPJD file is not (a rerun redoes it).
    assert (tmp_path / "rejects" / "shard-00007.parquet").exists()
    assert not (tmp_path / "ppjd" / "shard-00007.parquet").exists()

    # The fraction is of the rows that reached the stage: 1 row rejected at load, then 10 of the
    # 11 left at vqa (0.91 > 0.9) fails, while 9 of 11 (0.82) passes.
    with pytest.raises(RejectRateError, match=r"stage 'vqa' rejected 10 of the 11"):
        writer.write_shard(1, _work_rows(12, {"load": 1, "vqa": 10}))
    stats = json.loads(writer.write_shard(2, _work_rows(12, {"load": 1, "vqa": 9})))
    assert stats["kept"] == 2 and stats["rejected_by_stage"] == {"load": 1, "vqa": 9}
    # A stage that fewer than MIN_ROWS_CHECKED rows reach is not judged; 1.0 disables the check.
    assert (
        json.loads(writer.write_shard(3, _work_rows(MIN_ROWS_CHECKED - 1, {"load": MIN_ROWS_CHECKED - 1})))["kept"] == 0
    )
    assert json.loads(ShardWriter(str(tmp_path), 3, 1.0).write_shard(4, _work_rows(12, {"load": 12})))["kept"] == 0


@pytest.mark.parametrize("k", [3, 5])
def test_rules_levels_on_scenes_are_verifiably_wrong_and_ordered(k):
    frame = _frame(0, scene_rows(20, seed=3, image_size=96))
    for row in frame.to_dict("records"):
        assert load_row(row) is None and perturb_rules(row, k) is None
        assert check_finals(row) is None and vqa_oracle(row) is None
        from pjray.ppjd.stages import _scene_qa

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
