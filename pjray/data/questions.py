"""A policy's training rows (task.kind=policy): an image, a question and, where known, its answer.

From scenes (`scene_questions`: the scene world's questions with their true finals and scene
references, which the oracle reads), or from any dataset `datasets` opens, a hub id or a folder
of JSONL or parquet files (`dataset_questions`: columns image, question and answer, renamed
with data.columns), each row checked and a bad one kept as a reject with its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pjray.config import DataConfig
from pjray.data.hf import open_dataset, scan_source, train_ref
from pjray.data.images import decode_image
from pjray.data.scenes import render, scene_ref, split_qas
from pjray.data.sources import DataError, Rows, image_bytes
from pjray.types import Question

# The columns a question row is read from (data.columns renames them).
QUESTION_COLUMNS = ("id", "image", "question", "answer", "source")


def scene_questions(d: DataConfig) -> Rows[Question]:
    """data.num_items scene questions of data.scene_kinds (cycled) on scenes of data.scene_split,
    scene seeds drawn from data.seed."""
    qas = split_qas(
        d.num_items, lambda j: d.seed * 1_000_003 + j, d.scene_split, d.image_size, d.scene_kinds, d.scene_objects
    )
    rows = [
        Question(
            id=f"scene-{qa.scene.seed}-{qa.kind}",
            image=render(qa.scene),
            question=qa.question,
            reference=qa.final,
            source="scenes",
            scene=scene_ref(qa),
        )
        for qa in qas
    ]
    return Rows("scenes", rows)


def question_row(raw: Any, root: Path, where: str, columns: dict[str, str], source: str) -> Question:
    """One dataset row as a `Question`; `DataError` naming the row when it has no image that
    decodes or no question."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a {type(raw).__name__}, expected a row of named fields")
    get = {name: raw.get(columns.get(name, name)) for name in QUESTION_COLUMNS}
    image = image_bytes(get["image"], root, where, key=columns.get("image", "image"))
    if image is None:
        raise DataError(f"{where}: no image")
    try:
        decode_image(image)
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None
    question = get["question"]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: no question")
    answer = get["answer"]
    return Question(
        id=str(get["id"]) if get["id"] is not None else where,
        image=image,
        question=question,
        reference=None if answer is None or str(answer).strip() == "" else str(answer),
        source=str(get["source"] or source),
    )


def dataset_questions(d: DataConfig) -> Rows[Question]:
    """Every row of the dataset data.* names, as questions or rejects."""
    data = open_dataset(train_ref(d))
    missing = [name for name in ("image", "question") if d.columns.get(name, name) not in data.columns]
    if missing:
        raise DataError(
            f"{data.label}: no column for {', '.join(missing)} (columns: {', '.join(data.columns)}); name yours "
            f"with data.columns.{missing[0]}=COLUMN"
        )
    return scan_source(data, lambda raw, root, where: question_row(raw, root, where, dict(d.columns), data.label))


def training_questions(d: DataConfig) -> Rows[Question]:
    """A policy's rows: scenes, or the dataset (data.source=hf); checked against
    data.max_reject_fraction."""
    rows = scene_questions(d) if d.source == "scenes" else dataset_questions(d)
    rows.check(d.max_reject_fraction)
    return rows
