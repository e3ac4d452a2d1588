"""The PPJD row schema on disk (parquet) and reading/writing `JudgeItem`s.

One row per ranked tuple:
    id: string, image: binary (encoded PNG/JPEG), question: string,
    candidates: list<string> (K answers), order: list<int32> (candidate indices, best -> worst),
    source: string, meta: string (JSON object: perturbation metadata)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

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


T = TypeVar("T")


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


@dataclass(frozen=True)
class RowReject:
    """A row left out of a run: where it is ("file.parquet row 7"), its id, and why."""

    where: str
    row_id: str
    reason: str


@dataclass
class Rows(Generic[T]):
    """What reading a data file gave: the usable rows and the rejected ones."""

    source: str
    rows: list[T] = field(default_factory=list)
    rejects: list[RowReject] = field(default_factory=list)

    def check(self, max_fraction: float, error: type[InputError] | None = None) -> None:
        """Raise `error` (`DataError`), naming the first rejects, when more than `max_fraction`
        of the rows are bad (or none is usable): a few corrupt rows are skipped, a broken file
        is not."""
        error = error or DataError
        total = len(self.rows) + len(self.rejects)
        if not total:
            raise error(f"{self.source}: no rows")
        if self.rows and len(self.rejects) <= max_fraction * total:
            return
        first = "; ".join(f"{r.where}: {r.reason}" for r in self.rejects[:3])
        raise error(
            f"{self.source}: {len(self.rejects)} of {total} rows are bad (more than data.max_reject_fraction="
            f"{max_fraction:g}): {first}{'; ...' if len(self.rejects) > 3 else ''}"
        )


def write_rejects(rejects: list[RowReject], path: Path) -> None:
    """One JSON object a line: where, id, reason (an empty file: nothing was rejected)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rejects), encoding="utf-8")


def check_item(item: JudgeItem, where: str, num_candidates: int) -> None:
    """What a row needs beyond its schema to be judged: K candidates and an image that decodes."""
    from pjray.models.loading import decode_image  # torch and transformers: only when reading rows

    if num_candidates and len(item.candidates) != num_candidates:
        raise DataError(f"{where}: {len(item.candidates)} candidates, expected {num_candidates} (data.num_candidates)")
    try:
        decode_image(item.image)
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None


def scan_items(path: str | Path, num_candidates: int = 0) -> Rows[JudgeItem]:
    """Every PPJD row under `path` (a parquet file or a directory of them), checked: fields,
    order, `num_candidates` (0: any K) and the image; a bad row is a `RowReject`, not an error.
    A file without the PPJD columns is an error: it is not a bad row but the wrong file."""
    out: Rows[JudgeItem] = Rows(str(path))
    for file in parquet_files(path):
        table = pq.read_table(file)
        absent = [name for name in PPJD_SCHEMA.names if name not in table.column_names and name != "meta"]
        if absent:
            raise DataError(f"{file}: missing column(s) {', '.join(absent)}")
        for index, row in enumerate(table.to_pylist()):
            where = f"{file} row {index}"
            try:
                item = row_to_item(row, where)
                check_item(item, where, num_candidates)
            except DataError as err:
                out.rejects.append(RowReject(where, str(row.get("id") or ""), str(err).removeprefix(f"{where}: ")))
                continue
            out.rows.append(item)
    return out


def read_items(path: str | Path) -> list[JudgeItem]:
    """Every PPJD row under `path`; any bad row is an error naming it (`scan_items` skips them)."""
    rows = scan_items(path)
    rows.check(0.0)
    return rows.rows
