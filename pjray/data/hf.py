"""Training and evaluation rows from Hugging Face `datasets`: a hub id, a folder written by
`save_to_disk`, or a folder of data files (parquet, JSONL, ...) that `load_dataset` reads.

`open_dataset` finds the dataset, its subset and split (a missing one is a `PathError` naming
what exists), and hands back its rows as a `datasets.IterableDataset` with media left encoded
(`decode(False)`: an `Image` column gives {bytes, path}); a streamed dataset reads rows as they
are needed, any other is read from `datasets`' cache or memory map. `DatasetItems` maps its
columns onto the PPJD fields (by name, or by `data.columns`; chosen/rejected pairs give K = 2
tuples) and checks each row as the parquet reader does: a bad row is a `RowReject`.
`StreamSampler` hands out the items of a streamed dataset with the stream's position in its
state, so a checkpoint resumes at the row it stopped at.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import datasets
from datasets.data_files import EmptyDatasetError
from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError

from pjray.config import DATA_COLUMNS, ConfigError, DataConfig, EvalConfig, PathError
from pjray.data.sources import DataError, RowReject, Rows, check_item, file_rows, row_to_item, scan_items
from pjray.errors import first_line
from pjray.inputs import check_dataset
from pjray.types import JudgeItem

# A stream's reject fraction is judged once this many rows were read (or at the end of its first
# pass): a few bad rows early in a large dataset must not end the run.
STREAM_CHECK_ROWS = 1000

T = TypeVar("T")


@dataclass(frozen=True)
class DatasetRef:
    """A dataset as the config names it; `section` (data | eval) names the keys in errors."""

    path: str
    split: str = ""  # empty: the dataset's only split
    subset: str = ""
    revision: str = ""
    section: str = "data"

    @property
    def path_key(self) -> str:
        return "data.path" if self.section == "data" else "eval.data"


@dataclass
class OpenDataset:
    """One split of a dataset, ready to read."""

    rows: datasets.IterableDataset  # media undecoded
    label: str  # "owner/name [train]": rows are named "<label> row <i>"
    root: Path  # image paths in rows are relative to it (a local folder; else the working dir)
    columns: list[str]

    def named_rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for index, raw in enumerate(self.rows):
            yield f"{self.label} row {index}", raw


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return any(
        (path / name).is_file()
        for name in (datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME)
    )


def _hub_call(ref: DatasetRef, call: Callable[[], T]) -> T:
    """`call()`, with the ways `datasets` says a dataset is not there turned into one line."""
    try:
        return call()
    except DatasetNotFoundError as err:  # missing, private or gated: its message says which
        raise PathError(
            f"{ref.path_key}: {ref.path}: no such folder, and the hub does not give it ({first_line(str(err))})"
        ) from None
    except (EmptyDatasetError, DataFilesNotFoundError) as err:
        raise PathError(f"{ref.path_key}: {ref.path}: no data files ({first_line(str(err))})") from None
    except ConnectionError as err:
        raise PathError(
            f"{ref.path_key}: {ref.path}: no such folder, and not in the datasets cache; the hub could not be "
            f"asked ({first_line(str(err))})"
        ) from None


def _pick_split(ref: DatasetRef, splits: list[str]) -> str:
    if not ref.split:
        if len(splits) != 1:
            raise PathError(f"{ref.section}.split: {ref.path} has splits {', '.join(splits)}; name one")
        return splits[0]
    if ref.split not in splits:
        raise PathError(f"{ref.section}.split: {ref.split}: no such split of {ref.path} (splits: {', '.join(splits)})")
    return ref.split


def _open_saved(ref: DatasetRef) -> tuple[datasets.IterableDataset, str]:
    """A `save_to_disk` folder (memory-mapped, so it is never held in memory) and its split."""
    if ref.subset:
        raise PathError(f"{ref.section}.subset: {ref.subset}: a saved dataset ({ref.path}) has no subsets")
    saved = datasets.load_from_disk(ref.path)
    if isinstance(saved, datasets.DatasetDict):
        split = _pick_split(ref, list(saved))
        return saved[split].to_iterable_dataset(), split
    return saved.to_iterable_dataset(), str(saved.split or ref.split or "train")  # one split, whatever its name


def _open_loadable(ref: DatasetRef, streaming: bool) -> tuple[datasets.IterableDataset, str]:
    """A hub dataset or a folder of data files, through `load_dataset`, and its split."""
    subset, revision = ref.subset or None, ref.revision or None
    if subset:
        subsets = _hub_call(ref, lambda: datasets.get_dataset_config_names(ref.path, revision=revision))
        if subset not in subsets:
            raise PathError(
                f"{ref.section}.subset: {subset}: no such subset of {ref.path} (subsets: {', '.join(subsets)})"
            )
    split = _pick_split(
        ref, _hub_call(ref, lambda: datasets.get_dataset_split_names(ref.path, subset, revision=revision))
    )
    loaded = _hub_call(
        ref, lambda: datasets.load_dataset(ref.path, subset, split=split, revision=revision, streaming=streaming)
    )
    return (loaded if streaming else loaded.to_iterable_dataset()), split


def open_dataset(ref: DatasetRef, streaming: bool = False) -> OpenDataset:
    """The split `ref` names, checked: the folder or hub dataset, its subset and split exist.
    `streaming` reads a hub dataset or data files as they are needed instead of preparing them
    in `datasets`' cache first."""
    check_dataset(ref.path_key, ref.path)
    local = Path(ref.path)
    if local.exists() and ref.revision:
        raise PathError(
            f"{ref.section}.revision: {ref.revision}: only for a hub dataset ({ref.path} is a local folder)"
        )
    rows, split = _open_saved(ref) if is_saved_dataset(local) else _open_loadable(ref, streaming)
    rows = rows.decode(False)
    label = f"{ref.path} [{ref.subset + '/' if ref.subset else ''}{split}]"
    columns = rows.column_names or list(next(iter(rows), {}))  # a stream may not know its features before a row
    return OpenDataset(rows, label, local if local.is_dir() else Path("."), columns)


# --------------------------------------------------------------------------- PPJD columns


@dataclass(frozen=True)
class ColumnMap:
    """Which dataset column holds each field (`DATA_COLUMNS` of pjray.config); `pairs`: the rows
    are chosen/rejected pairs, read as K = 2 tuples (chosen best)."""

    fields: dict[str, str]
    pairs: bool


def map_columns(columns: list[str], mapping: Mapping[str, str], label: str) -> ColumnMap:
    """Each field's column: `mapping[field]` if given, else the column of the field's own name."""
    for name, column in mapping.items():
        if column not in columns:
            raise DataError(f"{label}: data.columns.{name}={column}: no such column (columns: {', '.join(columns)})")
    named = {name: mapping.get(name, name) for name in DATA_COLUMNS}
    fields = {name: column for name, column in named.items() if column in columns}
    pairs = "candidates" not in fields and {"chosen", "rejected"} <= set(fields)
    needed = ["image", "question", *(("chosen", "rejected") if pairs else ("candidates", "order"))]
    missing = [name for name in needed if name not in fields]
    if missing:
        pairs_hint = " (a pair dataset: chosen and rejected)" if "candidates" in missing else ""
        raise DataError(
            f"{label}: no column for {', '.join(missing)} (columns: {', '.join(columns)}); name yours with "
            f"data.columns.{missing[0]}=COLUMN{pairs_hint}"
        )
    return ColumnMap(fields, pairs)


def ppjd_row(
    raw: dict[str, Any], columns: ColumnMap, where: str, default_id: str, default_source: str
) -> dict[str, Any]:
    """A dataset row in the PPJD row layout that `row_to_item` checks."""
    get = {name: raw.get(column) for name, column in columns.fields.items()}
    if columns.pairs:
        missing = [name for name in ("chosen", "rejected") if get[name] is None]
        if missing:
            raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
        candidates, order = [get["chosen"], get["rejected"]], [0, 1]
    else:
        candidates, order = get["candidates"], get["order"]
    meta = get.get("meta")
    return {
        "id": default_id if get.get("id") is None else get["id"],
        "image": get["image"],
        "question": get["question"],
        "candidates": candidates,
        "order": order,
        "source": get.get("source") or default_source,
        "meta": meta if meta is None or isinstance(meta, str) else json.dumps(meta),
    }


class DatasetItems:
    """A dataset split's rows as checked `JudgeItem`s."""

    def __init__(self, data: OpenDataset, mapping: Mapping[str, str], num_candidates: int, source: str):
        self.data, self.num_candidates, self.source = data, num_candidates, source
        self.columns = map_columns(data.columns, mapping, data.label)
        if self.columns.pairs and num_candidates not in (0, 2):
            raise DataError(
                f"{data.label}: chosen/rejected pairs are K = 2 tuples, but data.num_candidates={num_candidates}; "
                "set data.num_candidates=2"
            )

    def item(self, index: int, raw: dict[str, Any]) -> JudgeItem:
        """The checked item of row `index`; `DataError` naming the row if it is bad."""
        where = f"{self.data.label} row {index}"
        row = ppjd_row(raw, self.columns, where, default_id=str(index), default_source=self.source)
        item = row_to_item(row, where, self.data.root)
        check_item(item, where, self.num_candidates)
        return item

    def scan(self) -> Rows[JudgeItem]:
        """Every row, read once: the good ones as items, the bad ones as rejects."""
        out: Rows[JudgeItem] = Rows(self.data.label)
        for index, raw in enumerate(self.data.rows):
            try:
                out.rows.append(self.item(index, raw))
            except DataError as err:
                out.rejects.append(_reject(self.data.label, index, raw, self.columns, err))
        return out


def _reject(label: str, index: int, raw: dict[str, Any], columns: ColumnMap, err: DataError) -> RowReject:
    where = f"{label} row {index}"
    row_id = raw.get(columns.fields["id"]) if "id" in columns.fields else index
    return RowReject(where, str(row_id), str(err).removeprefix(f"{where}: "))


def train_ref(d: DataConfig) -> DatasetRef:
    """The dataset `data.*` names (data.source=hf)."""
    return DatasetRef(d.path, d.split, d.subset, d.revision, section="data")


def eval_source(e: EvalConfig) -> str | OpenDataset:
    """`eval.data` as the loaders take it: a file path, or the opened dataset (a folder or a hub id)."""
    if Path(e.data).is_file():
        for key in ("split", "subset", "revision"):
            if getattr(e, key):
                raise ConfigError(
                    f"eval.{key}: only read when eval.data is a dataset (a folder or a hub id), not a file"
                )
        return e.data
    return open_dataset(DatasetRef(e.data, e.split, e.subset, e.revision, section="eval"))


def scan_source(
    source: str | Path | OpenDataset,
    parse: Callable[[Any, Path, str], T],
    image_dir: str | Path | None = None,
    limit: int = 0,
    error: type[DataError] = DataError,
) -> Rows[T]:
    """The rows of a benchmark file (parquet, a JSON list, JSONL) or a dataset (`open_dataset`),
    each made by `parse(raw, image root, where)`, up to `limit` good ones (0: all). A row that is
    not JSON, or that `parse` refuses with a `DataError`, is a reject naming the file (or dataset)
    and row; image paths are relative to `image_dir`, else the file's folder or the dataset's."""
    if isinstance(source, OpenDataset):
        root = Path(image_dir) if image_dir else source.root
        out: Rows[T] = Rows(source.label)
        raws: Iterator[tuple[str, Any]] = source.named_rows()
    else:
        path = Path(source)
        if not path.is_file():
            raise error(f"{path}: no such file")
        root = Path(image_dir) if image_dir else path.parent
        out = Rows(str(path))
        raws = file_rows(path, out)
    for where, raw in raws:
        try:
            out.rows.append(parse(raw, root, where))
        except DataError as err:
            row_id = str(raw.get("id", raw.get("ID", ""))) if isinstance(raw, dict) else ""
            out.rejects.append(RowReject(where, row_id, str(err).removeprefix(f"{where}: ")))
        if limit and len(out.rows) >= limit:
            break
    return out


def scan_judge_items(source: str | OpenDataset) -> Rows[JudgeItem]:
    """PPJD items of any K from a parquet file, or from a dataset by column name."""
    if isinstance(source, OpenDataset):
        return DatasetItems(source, {}, 0, source.label).scan()
    return scan_items(source)


# --------------------------------------------------------------------------- streaming


@dataclass
class StreamState:
    consumed: int = 0  # items handed out since the start of training, over all passes
    epoch: int = 0  # passes over the dataset completed
    row: int = 0  # rows of this pass read (good and bad)
    rejected: int = 0  # bad rows of the first pass, listed in the rejects file
    position: dict[str, Any] | None = None  # the stream's state_dict() after `row` rows


class StreamSampler:
    """Hands out the items of a streamed dataset in its order, pass after pass. The state holds
    the stream's position (`IterableDataset.state_dict`), so a resumed run continues at the row
    after the last one read. Bad rows of the first pass are appended to `rejects_path` (cut back
    to the state's count on resume); the run fails when more than `max_reject_fraction` of the
    rows read are bad (judged from STREAM_CHECK_ROWS rows on, and at the end of the first pass)."""

    def __init__(
        self,
        items: DatasetItems,
        state: StreamState | None,
        rejects_path: Path,
        max_reject_fraction: float,
        reject: Callable[[JudgeItem], str | None] = lambda item: None,
    ):
        self.items, self.rejects_path, self.max_reject_fraction = items, rejects_path, max_reject_fraction
        self.reject = reject  # why a well-formed item cannot be used (the trainer's: overlong), or None
        self.state = state or StreamState()
        self._start = items.data.rows.state_dict()
        kept = rejects_path.read_text(encoding="utf-8").splitlines(keepends=True) if rejects_path.exists() else []
        rejects_path.parent.mkdir(parents=True, exist_ok=True)
        rejects_path.write_text("".join(kept[: self.state.rejected]), encoding="utf-8")
        self._rows = self._iterate(self.state.position)

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def _iterate(self, position: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        self.items.data.rows.load_state_dict(position or self._start)
        return iter(self.items.data.rows)

    def take(self, n: int) -> list[tuple[int, JudgeItem]]:
        """The next n good items with their global sample index (stable across resumes)."""
        out: list[tuple[int, JudgeItem]] = []
        while len(out) < n:
            raw = next(self._rows, None)
            if raw is None:
                self._end_of_pass()
                continue
            index = self.state.row
            self.state.row += 1
            self.state.position = self.items.data.rows.state_dict()
            try:
                item = self.items.item(index, raw)
                reason = self.reject(item)
                if reason is not None:
                    raise DataError(reason)
            except DataError as err:
                if self.state.epoch == 0:
                    self._record(_reject(self.items.data.label, index, raw, self.items.columns, err))
                continue
            out.append((self.state.consumed, item))
            self.state.consumed += 1
        return out

    def _record(self, reject: RowReject) -> None:
        with self.rejects_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(dataclasses.asdict(reject)) + "\n")
        self.state.rejected += 1
        if self.state.row >= STREAM_CHECK_ROWS:
            self._check()

    def _check(self) -> None:
        read, bad = self.state.row, self.state.rejected
        if read > bad and bad <= self.max_reject_fraction * read:
            return
        listed = [json.loads(line) for line in self.rejects_path.read_text(encoding="utf-8").splitlines()[:3]]
        first = "; ".join(f"{r['where']}: {r['reason']}" for r in listed)
        raise DataError(
            f"{self.items.data.label}: {bad} of the {read} rows read are bad (more than data.max_reject_fraction="
            f"{self.max_reject_fraction:g}): {first}{'; ...' if bad > 3 else ''}"
        )

    def _end_of_pass(self) -> None:
        if self.state.epoch == 0:
            if not self.state.row:
                raise DataError(f"{self.items.data.label}: no rows")
            self._check()
        self.state.epoch += 1
        self.state.row = 0
        self.state.position = None
        self._rows = self._iterate(None)
