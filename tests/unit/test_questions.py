"""A policy's rows: scene questions with their oracle references, and any dataset's (image,
question, answer) rows, a bad row kept as a reject with its reason."""

from __future__ import annotations

import json

import pytest

from pjray.config import load
from pjray.data.prompts import render_question
from pjray.data.questions import dataset_questions, scene_questions, training_questions
from pjray.data.scenes import qa_from_ref
from pjray.data.sources import DataError
from tests.support.images import noisy_png


def test_scene_questions_carry_their_true_final_and_scene():
    cfg = load(overrides=["task.kind=policy", "data.num_items=6", "data.scene_kinds=[color,size]"])
    rows = scene_questions(cfg.data).rows
    assert len(rows) == 6 and len({q.id for q in rows}) == 6
    assert [qa_from_ref(q.scene).kind for q in rows] == ["color", "size"] * 3
    for q in rows:
        assert q.reference == qa_from_ref(q.scene).final and q.question == qa_from_ref(q.scene).question
    assert scene_questions(cfg.data) == scene_questions(cfg.data)  # a pure function of data.*


def write_rows(folder, rows):
    folder.mkdir()
    (folder / "a.png").write_bytes(noisy_png(16, 16, 0))
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_jsonl_folder_is_read_with_rejects_and_reasons(tmp_path):
    write_rows(
        tmp_path / "rows",
        [
            {"id": "ok", "picture": "a.png", "question": "What is it?", "answer": "noise"},
            {"id": "no-ref", "picture": "a.png", "question": "And this?"},
            {"id": "gone", "picture": "missing.png", "question": "?"},
            {"id": "blank", "picture": "a.png", "question": " "},
        ],
    )
    overrides = ["task.kind=policy", "data.source=hf", f"data.path={tmp_path / 'rows'}", "data.columns.image=picture"]
    cfg = load(overrides=[*overrides, "data.max_reject_fraction=0.5"])
    rows = training_questions(cfg.data)
    assert [(q.id, q.reference) for q in rows.rows] == [("ok", "noise"), ("no-ref", None)]
    reasons = {r.row_id: r.reason for r in rows.rejects}
    assert reasons["gone"].startswith("picture 'missing.png' not found under")
    assert reasons["blank"] == "no question"
    with pytest.raises(DataError, match="2 of 4 rows are bad"):
        training_questions(load(overrides=overrides).data)
    with pytest.raises(DataError, match="no column for image"):
        dataset_questions(load(overrides=[*overrides[:3]]).data)


def test_a_policy_prompt_asks_for_its_answer_style():
    reasoned = render_question("What colour?", None, item_id="x", reference="red")
    assert "Final Answer: red" in reasoned.system and reasoned.target == "red" and reasoned.protocol == "answer"
    assert "<answer>" in render_question("What colour?", None, style="short").system
