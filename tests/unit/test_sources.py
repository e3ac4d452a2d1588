"""The PPJD parquet schema: round trip, and bad rows named by file and row."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pjray.data.sources import PPJD_SCHEMA, DataError, read_items, write_items
from pjray.ppjd.perturb import scene_items


def test_round_trip_keeps_every_field(tmp_path):
    items = scene_items(5, seed=3, num_candidates=4, image_size=64)
    write_items(items[:3], tmp_path / "a" / "part-0.parquet")
    write_items(items[3:], tmp_path / "a" / "part-1.parquet")
    assert read_items(tmp_path / "a") == items


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=PPJD_SCHEMA), path)


def good_row(**changes):
    row = {"id": "x", "image": b"\x89PNG", "question": "q?", "candidates": ["a", "b", "c"],
           "order": [2, 0, 1], "source": "test", "meta": "{}"}
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
    ],
)
def test_bad_rows_are_named(tmp_path, row, message):
    path = tmp_path / "bad.parquet"
    write_rows(path, [good_row(), row])
    with pytest.raises(DataError, match=f"bad.parquet {message}"):
        read_items(path)


def test_missing_paths_and_columns(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_items(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match="no .parquet files"):
        read_items(tmp_path)
    pq.write_table(pa.table({"id": ["x"]}), tmp_path / "thin.parquet")
    with pytest.raises(DataError, match="missing column"):
        read_items(tmp_path / "thin.parquet")
