"""The PPJD row schema on disk (parquet) and reading/writing `JudgeItem`s.

One row per ranked tuple:
    id: string, image: binary (encoded PNG/JPEG), question: string,
    candidates: list<string> (K answers), order: list<int32> (candidate indices, best -> worst),
    source: string, meta: string (JSON object: perturbation metadata)
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pjray.errors import InputError
from pjray.types import JudgeItem

PPJD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("image", pa.binary()),
        ("question", pa.string()),
        ("candidates", pa.list_(pa.string())),
        ("order", pa.list_(pa.int32())),
        ("source", pa.string()),
        ("meta", pa.string()),
    ]
)


class DataError(InputError):
    """Bad input data: the message names the file and row."""

    what = "bad data"


def items_to_table(items: list[JudgeItem]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "id": it.id,
                "image": it.image,
                "question": it.question,
                "candidates": list(it.candidates),
                "order": list(it.order),
                "source": it.source,
                "meta": json.dumps(it.meta, sort_keys=True),
            }
            for it in items
        ],
        schema=PPJD_SCHEMA,
    )


def write_items(items: list[JudgeItem], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(items_to_table(items), path)
    return path


def row_to_item(row: dict, where: str) -> JudgeItem:
    """Validate one PPJD row; `where` ("file.parquet row 7") goes into every error."""
    missing = [name for name in PPJD_SCHEMA.names if row.get(name) is None and name != "meta"]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
    candidates = tuple(row["candidates"])
    order = tuple(int(i) for i in row["order"])
    if not 2 <= len(candidates) <= 26:
        raise DataError(f"{where}: {len(candidates)} candidates (need 2..26)")
    if sorted(order) != list(range(len(candidates))):
        raise DataError(f"{where}: order {list(order)} is not a permutation of the candidates")
    if not row["image"]:
        raise DataError(f"{where}: empty image")
    try:
        meta = json.loads(row["meta"]) if row.get("meta") else {}
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: meta is not JSON ({err})") from None
    return JudgeItem(
        id=str(row["id"]),
        image=bytes(row["image"]),
        question=str(row["question"]),
        candidates=candidates,
        order=order,
        source=str(row["source"]),
        meta=meta,
    )


def parquet_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        if files:
            return files
        raise DataError(f"{path}: no .parquet files in this directory")
    raise DataError(f"{path}: no such file or directory")


def read_items(path: str | Path) -> list[JudgeItem]:
    """Read every PPJD row under `path` (a parquet file or a directory of them)."""
    items: list[JudgeItem] = []
    for file in parquet_files(path):
        table = pq.read_table(file)
        absent = [name for name in PPJD_SCHEMA.names if name not in table.column_names and name != "meta"]
        if absent:
            raise DataError(f"{file}: missing column(s) {', '.join(absent)}")
        for index, row in enumerate(table.to_pylist()):
            items.append(row_to_item(row, f"{file} row {index}"))
    if not items:
        raise DataError(f"{path}: no rows")
    return items
