"""The PPJD row schema on disk (parquet) and reading/writing `JudgeItem`s.

One row per ranked tuple, as Hugging Face `datasets` features (`PPJD_FEATURES`; the parquet
files carry them in their schema metadata, so `datasets.load_dataset("parquet", ...)` reads the
image column as an `Image` feature):
    id: string, image: Image (encoded PNG/JPEG bytes), question: string,
    candidates: list<string> (K answers), order: list<int32> (candidate indices, best -> worst),
    source: string, meta: string (JSON object: perturbation metadata)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from pjray.data.images import decode_image
from pjray.errors import InputError
from pjray.types import JudgeItem

PPJD_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "image": datasets.Image(),
        "question": datasets.Value("string"),
        "candidates": datasets.List(datasets.Value("string")),
        "order": datasets.List(datasets.Value("int32")),
        "source": datasets.Value("string"),
        "meta": datasets.Value("string"),
    }
)
PPJD_SCHEMA = PPJD_FEATURES.arrow_schema


T = TypeVar("T")


class DataError(InputError):
    """Bad input data: the message names the file and row."""

    what = "bad data"


def items_to_table(items: list[JudgeItem]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "id": it.id,
                "image": {"bytes": it.image, "path": None},
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


def image_bytes(value: Any, root: Path, where: str, key: str = "image") -> bytes | None:
    """An image as encoded bytes, from what a data row's field `key` holds: bytes, an undecoded
    `datasets.Image` value {bytes, path}, a list of one image, or a path (relative to `root`).
    None when the row has none."""
    if isinstance(value, list):
        if len(value) > 1:
            raise DataError(f"{where}: {key} holds {len(value)} images; a judge prompt shows one")
        value = value[0] if value else None
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if not value:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    file = root / str(value)
    if not file.is_file():
        raise DataError(f"{where}: {key} {value!r} not found under {root}")
    return file.read_bytes()


def row_to_item(row: dict, where: str, root: Path = Path(".")) -> JudgeItem:
    """Validate one PPJD row; `where` ("file.parquet row 7") goes into every error, and an image
    path is relative to `root`."""
    missing = [name for name in PPJD_SCHEMA.names if row.get(name) is None and name != "meta"]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
    candidates = tuple(row["candidates"])
    if not all(isinstance(c, str) for c in candidates):
        kinds = sorted({type(c).__name__ for c in candidates if not isinstance(c, str)})
        raise DataError(f"{where}: a candidate is {', '.join(kinds)}, expected a string")
    order = tuple(int(i) for i in row["order"])
    if not 2 <= len(candidates) <= 26:
        raise DataError(f"{where}: {len(candidates)} candidates (need 2..26)")
    if sorted(order) != list(range(len(candidates))):
        raise DataError(f"{where}: order {list(order)} is not a permutation of the candidates")
    image = image_bytes(row["image"], root, where)
    if not image:
        raise DataError(f"{where}: empty image")
    try:
        meta = json.loads(row["meta"]) if row.get("meta") else {}
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: meta is not JSON ({err})") from None
    return JudgeItem(
        id=str(row["id"]),
        image=image,
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


def file_rows(path: Path, out: Rows) -> Iterator[tuple[str, Any]]:
    """(where, raw row) of a parquet file, a JSON list or a JSONL file (by suffix: .parquet,
    .json, anything else JSONL); a JSONL line that is not JSON becomes a reject in `out`, a JSON
    file that is not a list of rows an error naming it."""
    if path.suffix == ".parquet":
        for i, raw in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", raw
        return
    if path.suffix == ".json":
        try:
            listed = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not JSON ({err})") from None
        if not isinstance(listed, list):
            raise DataError(f"{path}: a JSON {type(listed).__name__}, expected a list of rows")
        for i, raw in enumerate(listed):
            yield f"{path} row {i}", raw
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                out.rejects.append(RowReject(where, "", f"not JSON ({err})"))


def write_rejects(rejects: list[RowReject], path: Path) -> None:
    """One JSON object a line: where, id, reason (an empty file: nothing was rejected)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rejects), encoding="utf-8")


def check_item(item: JudgeItem, where: str, num_candidates: int) -> None:
    """What a row needs beyond its schema to be judged: K candidates and an image that decodes."""
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
