"""The PPJD parquet schema: round trip, and bad rows named by file and row."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pjray.data.sources import PPJD_SCHEMA, DataError, read_items, scan_items, write_items, write_rejects
from pjray.ppjd.perturb import scene_items


def test_round_trip_keeps_every_field(tmp_path):
    items = scene_items(5, seed=3, num_candidates=4, image_size=64)
    write_items(items[:3], tmp_path / "a" / "part-0.parquet")
    write_items(items[3:], tmp_path / "a" / "part-1.parquet")
    assert read_items(tmp_path / "a") == items


def write_rows(path, rows):
    """PPJD rows as the job writes them: the image as a `datasets.Image` value {bytes, path}."""
    rows = [{**row, "image": {"bytes": row["image"], "path": None}} for row in rows]
    pq.write_table(pa.Table.from_pylist(rows, schema=PPJD_SCHEMA), path)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def good_row(**changes):
    row = {
        "id": "x",
        "image": png(),
        "question": "q?",
        "candidates": ["a", "b", "c"],
        "order": [2, 0, 1],
        "source": "test",
        "meta": "{}",
    }
    row.update(changes)
    return row


@pytest.mark.parametrize(
    "row, message",
    [
        (good_row(order=[0, 0, 1]), "row 1: order"),
        (good_row(candidates=["only"], order=[0]), "row 1: 1 candidates"),
        (good_row(question=None), "row 1: missing field"),
        (good_row(image=b""), "row 1: empty image"),
        (good_row(meta="{not json"), "row 1: meta is not JSON"),
        (good_row(image=png()[:40]), "row 1: could not decode image"),
    ],
)
def test_bad_rows_are_named(tmp_path, row, message):
    path = tmp_path / "bad.parquet"
    write_rows(path, [good_row(), row])
    with pytest.raises(DataError, match=f"bad.parquet {message}"):
        read_items(path)


def test_a_binary_image_column_reads_too(tmp_path):
    """PPJD files from before the Image feature held the encoded image as plain binary."""
    schema = PPJD_SCHEMA.set(PPJD_SCHEMA.get_field_index("image"), pa.field("image", pa.binary())).remove_metadata()
    pq.write_table(pa.Table.from_pylist([good_row()], schema=schema), tmp_path / "old.parquet")
    assert read_items(tmp_path / "old.parquet")[0].image == png()


def test_missing_paths_and_columns(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_items(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match="no .parquet files"):
        read_items(tmp_path)
    pq.write_table(pa.table({"id": ["x"]}), tmp_path / "thin.parquet")
    with pytest.raises(DataError, match="missing column"):
        read_items(tmp_path / "thin.parquet")


def test_bad_rows_are_skipped_and_named_up_to_the_allowed_fraction(tmp_path):
    path = tmp_path / "mixed.parquet"
    rows = [good_row(id=f"r{i}") for i in range(20)]
    rows[3] = good_row(id="r3", image=png()[:40])
    rows[11] = good_row(id="r11", candidates=["a", "b"], order=[1, 0])
    write_rows(path, rows)
    scanned = scan_items(path, num_candidates=3)
    assert [it.id for it in scanned.rows] == [f"r{i}" for i in range(20) if i not in (3, 11)]
    assert [(r.where, r.row_id) for r in scanned.rejects] == [(f"{path} row 3", "r3"), (f"{path} row 11", "r11")]
    assert scanned.rejects[0].reason.startswith("could not decode image")
    assert scanned.rejects[1].reason == "2 candidates, expected 3 (data.num_candidates)"
    scanned.check(0.1)  # 2 of 20
    with pytest.raises(
        DataError,
        match=r"mixed.parquet: 2 of 20 rows are bad \(more than data.max_reject_fraction=0.05\): .*row 3: could not decode",
    ):
        scanned.check(0.05)
    write_rejects(scanned.rejects, tmp_path / "rejects.jsonl")
    listed = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row_id"], r["where"]) for r in listed] == [("r3", f"{path} row 3"), ("r11", f"{path} row 11")]


def test_a_file_of_only_bad_rows_fails_whatever_the_fraction(tmp_path):
    write_rows(tmp_path / "bad.parquet", [good_row(image=b"junk")])
    with pytest.raises(DataError, match="1 of 1 rows are bad"):
        scan_items(tmp_path / "bad.parquet").check(1.0)
