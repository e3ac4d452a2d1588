"""Inputs of the PPJD job, as `RawRow`s: one source row each, images not yet loaded.

- `scenes`: synthetic scenes with ground-truth facts (the image is rendered later, in the
  pipeline's load stage, from the scene seed).
- `mmpr`: MMPR-v1.2 as published: `meta.json` maps names to `{root, annotation, ...}`; each
  annotation is JSONL with `image` (relative to `root`), `question`, `chosen`, `rejected`, and
  the ground truth under one of ANSWER_KEYS (the names the released construction code maps).
- `jsonl` / `parquet`: generic rows with `question`, `chosen` (or `response`), an answer under
  ANSWER_KEYS, and the image as a path (`image` / `image_path`, relative to the file) or bytes.

Reading never drops a row: a line that is not JSON becomes a row that carries its reject reason,
and missing fields are left empty for the load stage to reject by name.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pjray.config import PathError
from pjray.data.scenes import KINDS, scene_ref, split_qas
from pjray.ppjd.perturb import _scene_seed, item_id

# The answer field names the released code maps (MMPR files disagree on the name).
ANSWER_KEYS = ("answer", "answer_gt", "ground_truth", "gt", "label")


@dataclass
class RawRow:
    """One source row before the pipeline. Strings are "" when absent; never None."""

    id: str
    source: str
    question: str = ""
    chosen: str = ""
    answer: str = ""  # ground truth; "" when the source has none
    image: bytes = b""  # encoded image bytes when the source holds them
    image_path: str = ""  # absolute path when the source points at a file
    scene: str = ""  # JSON {"seed", "image_size", "kind"} for synthetic scenes
    where: str = ""  # "file line n", for error messages
    reject_stage: str = ""
    reject_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra"] = json.dumps(d["extra"], sort_keys=True, default=str)
        return d


def scene_rows(
    num_items: int,
    seed: int,
    image_size: int,
    kinds: Sequence[str] = KINDS,
    objects: Sequence[int] = (2, 5),
    split: str = "all",
) -> list[RawRow]:
    """The same scenes and questions as `pjray.ppjd.perturb.scene_items` (`kinds` cycle, each
    scene holds `objects` = (min, max) objects and lies in the content `split`)."""
    rows = []
    for i, qa in enumerate(split_qas(num_items, lambda j: _scene_seed(seed, j), split, image_size, kinds, objects)):
        rows.append(
            RawRow(
                id=item_id(qa),
                source="scenes",
                question=qa.question,
                chosen=qa.answer,
                answer=qa.final,
                scene=json.dumps(scene_ref(qa)),
                where=f"scene {i}",
            )
        )
    return rows


def _text(record: dict[str, Any], *keys: str) -> str:
    for key in keys:
        value = record.get(key)
        if value is not None and not isinstance(value, (dict, list)) and str(value).strip():
            return str(value)
    return ""


def _image_field(record: dict[str, Any], root: Path) -> tuple[bytes, str]:
    """(bytes, path) of the record's image: a path relative to `root`, raw bytes or base64."""
    for key in ("image", "image_path", "images"):
        value = record.get(key)
        if isinstance(value, list):  # MMPR and verl write one-image lists
            value = value[0] if value else None
        if isinstance(value, dict):  # HF datasets' {"bytes", "path"}
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return bytes(value), ""
        if isinstance(value, str) and value:
            if value.startswith("data:image") and "," in value:
                return base64.b64decode(value.split(",", 1)[1]), ""
            return b"", str((root / value).resolve())
    return b"", ""


def _row_from_record(record: Any, source: str, root: Path, where: str, row_id: str) -> RawRow:
    if not isinstance(record, dict):
        return RawRow(
            row_id,
            source,
            where=where,
            reject_stage="read",
            reject_reason=f"{where}: expected a JSON object, got {type(record).__name__}",
        )
    image, image_path = _image_field(record, root)
    return RawRow(
        id=_text(record, "id") or row_id,
        source=source,
        question=_text(record, "question", "prompt", "query"),
        chosen=_text(record, "chosen", "response"),
        answer=_text(record, *ANSWER_KEYS),
        image=image,
        image_path=image_path,
        where=where,
    )


def _jsonl_rows(path: Path, source: str, root: Path, prefix: str) -> Iterator[RawRow]:
    if not path.is_file():
        raise PathError(f"ppjd.paths: {path}: annotation file does not exist")
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where, row_id = f"{path} line {n}", f"{prefix}-{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield RawRow(
                    row_id, source, where=where, reject_stage="read", reject_reason=f"{where}: not JSON ({err.msg})"
                )
                continue
            yield _row_from_record(record, source, root, where, row_id)


def mmpr_rows(meta_path: str | Path, names: Sequence[str] = ()) -> list[RawRow]:
    """Rows of the MMPR-v1.2 annotations listed in `meta.json` (all, or only `names`)."""
    meta_path = Path(meta_path)
    if not meta_path.is_file():
        raise PathError(f"ppjd.paths: {meta_path}: no such file (MMPR meta.json)")
    meta = json.loads(meta_path.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object mapping names to {{root, annotation}}")
    rows: list[RawRow] = []
    for name, entry in meta.items():
        if names and name not in names:
            continue
        for key in ("root", "annotation"):
            if not isinstance(entry, dict) or key not in entry:
                raise ValueError(f"{meta_path}: entry {name!r} has no {key!r}")
        base = meta_path.parent
        root, annotation = base / entry["root"], base / entry["annotation"]
        rows.extend(_jsonl_rows(annotation, "mmpr", root, f"mmpr-{name}"))
    return rows


def file_rows(paths: Sequence[str | Path], source: str) -> list[RawRow]:
    """Generic JSONL or parquet rows; image paths resolve relative to the file's folder."""
    rows: list[RawRow] = []
    for p in paths:
        path = Path(p)
        if path.suffix == ".parquet":
            if not path.is_file():
                raise PathError(f"ppjd.paths: {path}: no such file")
            for n, record in enumerate(pq.read_table(path).to_pylist()):
                rows.append(_row_from_record(record, source, path.parent, f"{path} row {n}", f"{path.stem}-{n}"))
        else:
            rows.extend(_jsonl_rows(path, source, path.parent, path.stem))
    return rows


def read_source(
    kind: str,
    paths: Sequence[str],
    num_items: int,
    seed: int,
    image_size: int,
    scene_kinds: Sequence[str] = KINDS,
    scene_objects: Sequence[int] = (2, 5),
    scene_split: str = "all",
) -> list[RawRow]:
    """All raw rows of the configured source, in a stable order (shards are cut from it)."""
    if kind == "scenes":
        return scene_rows(num_items, seed, image_size, scene_kinds, scene_objects, scene_split)
    if kind == "mmpr":
        return [r for p in paths for r in mmpr_rows(p)]
    if kind in ("jsonl", "parquet"):
        return file_rows(paths, kind)
    raise ValueError(f"ppjd.source={kind!r}: expected scenes, mmpr, jsonl or parquet")
