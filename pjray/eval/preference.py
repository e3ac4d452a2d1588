"""The pairwise preference benchmarks' shared parts: a row, a judge output (`Sample`), where the
preferred response was shown, the paper prompt's choice, and what a benchmark module provides
(`PreferenceBench`). The benchmarks: `pjray.eval.vl_rewardbench`, `pjray.eval.mm_rewardbench`;
their evaluation: `pjray.eval.reward_bench`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pjray.data.sources import DataError
from pjray.eval.report import Cell
from pjray.reward.parse import parse_pair


class PreferenceDataError(DataError):
    """A bad benchmark row or outputs line: the message names the file, row and key."""

    what = "bad data"


@dataclass(frozen=True)
class PreferenceRow:
    """One benchmark row. `index`: its 0-based position among the rows read (the outputs file's
    `row`); `key`: what the official script keys an item by (rows with one key are one item
    there); `better`: 0 or 1, the response people preferred; `group`: the official scoring's group."""

    index: int
    id: str
    query: str
    responses: tuple[str, str]
    image: bytes | None
    better: int
    group: str
    key: str


@dataclass(frozen=True)
class Sample:
    """One judge output for one row: `swapped` is true when responses[1] was shown first."""

    row: int
    output: str
    swapped: bool
    seed: int | None = None  # the eval seed that generated it (None: read from eval.outputs)

    def line(self) -> dict[str, Any]:
        out: dict[str, Any] = {"row": self.row, "output": self.output, "swapped": self.swapped}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


def preferred_slot(row: PreferenceRow, swapped: bool) -> int:
    """1 or 2: where the preferred response was shown."""
    return 1 + (row.better ^ int(swapped))


def paper_choice(text: str) -> int | None:
    """The choice of a paper-prompt judgment: 1 or 2 (the higher of the two scores), None when
    the scores are unreadable or equal (neither benchmark has a tie)."""
    return {"A": 1, "B": 2}.get(parse_pair(text).ranking or "")


class PreferenceBench(Protocol):
    """What a preference benchmark's module provides (`pjray.eval.vl_rewardbench`,
    `pjray.eval.mm_rewardbench`): the module itself is the benchmark."""

    NAME: str
    SOURCE: str  # the official scoring script
    GROUPS: tuple[str, ...]  # the summary groups, in report order (rows of other groups come after)
    MACRO: str | None  # a row holding the mean of the GROUPS' values, where the official report has one
    # True: the official order is fixed (response 1 first; swapped samples are an extra order,
    # eval.both_orders); False: chosen per sample, so an outputs line must say `swapped`.
    FIXED_ORDER: bool

    def parse_row(self, raw: Any, root: Path, where: str, index: int) -> PreferenceRow: ...

    def official_prompt(self, row: PreferenceRow, swapped: bool) -> str: ...

    def swapped(self, row: PreferenceRow, seed: int) -> bool: ...

    def official_choice(self, text: str) -> int | None: ...

    def strict_choice(self, text: str) -> int | None: ...

    def official_tables(
        self, rows: Sequence[PreferenceRow], samples: Sequence[Sample], prompt_format: str
    ) -> tuple[dict[str, dict[str, Cell]], dict[str, str], list[str]]: ...


def samples_by_index(samples: Sequence[Sample]) -> dict[int, list[Sample]]:
    """Each row's samples in order: sample i of a row is its i-th line."""
    out: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        out[s.row].append(s)
    return out


def sample_files(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Sample i of every row, in file order, for each i: what an official script reading one
    output a row would see as answers file i."""
    files: list[list[Sample]] = []
    seen: dict[int, int] = defaultdict(int)
    for s in samples:
        i = seen[s.row]
        seen[s.row] += 1
        if i == len(files):
            files.append([])
        files[i].append(s)
    return files
