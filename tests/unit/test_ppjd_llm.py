"""The llm backend's strict JSON parsing and validation, and the LLM stage's rejects."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pjray.config import PPJDConfig
from pjray.ppjd.llm import (
    LLMReplyError,
    extract_messages,
    parse_extract,
    parse_json_object,
    parse_rewrite,
    parse_verify,
    rewrite_messages,
    verify_messages,
)
from pjray.ppjd.pipeline import _frame
from pjray.ppjd.sources import RawRow
from pjray.ppjd.stages import WORK_COLUMNS, LlmStage

CHOSEN = "The ball is red and there are 2 cats on the left. So the cats sit by the red ball.\nFinal Answer: 2"


def test_parse_json_object_accepts_a_fence_and_nothing_else():
    assert parse_json_object('```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_json_object('  {"a": 1}  ') == {"a": 1}
    for bad in ["", 'Sure! {"a": 1}', "[1, 2]", "{'a': 1}", '{"a": 1} trailing']:
        with pytest.raises(LLMReplyError):
            parse_json_object(bad)


def test_parse_verify():
    assert parse_verify('{"is_correct": true}') is True
    assert parse_verify('{"is_correct": false}') is False
    with pytest.raises(LLMReplyError, match="true or false"):
        parse_verify('{"is_correct": "yes"}')
    with pytest.raises(LLMReplyError, match="missing"):
        parse_verify('{"correct": true}')


def test_parse_extract_counts_and_lengths():
    assert parse_extract('{"perception_attrs": ["red ball", "two cats", "cats on the left"]}') == [
        "red ball",
        "two cats",
        "cats on the left",
    ]
    with pytest.raises(LLMReplyError, match="2 perception attributes"):
        parse_extract('{"perception_attrs": ["red ball", "two cats"]}')
    with pytest.raises(LLMReplyError, match="7 perception"):
        parse_extract(json.dumps({"perception_attrs": [f"fact {i}" for i in range(7)]}))
    with pytest.raises(LLMReplyError, match="over 9 words"):
        parse_extract(json.dumps({"perception_attrs": ["a b c d e f g h i j", "x", "y"]}))
    with pytest.raises(LLMReplyError, match="list of strings"):
        parse_extract('{"perception_attrs": "red ball"}')


def test_parse_rewrite_rejects_copies_and_duplicates():
    r1, r2 = CHOSEN.replace("red", "blue"), CHOSEN.replace("2", "3")
    assert parse_rewrite(json.dumps({"rejected_perception_1": r1, "rejected_perception_2": r2}), CHOSEN) == (r1, r2)
    with pytest.raises(LLMReplyError, match="unchanged"):
        parse_rewrite(json.dumps({"rejected_perception_1": CHOSEN, "rejected_perception_2": r2}), CHOSEN)
    with pytest.raises(LLMReplyError, match="same text"):
        parse_rewrite(json.dumps({"rejected_perception_1": r1, "rejected_perception_2": r1}), CHOSEN)
    with pytest.raises(LLMReplyError, match="extra"):
        parse_rewrite(json.dumps({"rejected_perception_1": r1, "rejected_perception_2": r2, "x": 1}), CHOSEN)


def test_messages_carry_the_inputs():
    assert "2+2" in verify_messages("2+2?", "4", "4")[1]["content"]
    assert "(none given)" in verify_messages("q", "a", "")[1]["content"]
    assert "the cats" in extract_messages("q", "the cats")[1]["content"]
    assert "red ball; two cats" in rewrite_messages("q", "c", ["red ball", "two cats"])[1]["content"]


class CannedTextEngine:
    """A stand-in text engine with the real `chat` interface, replying from a fixed script."""

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies = {k: list(v) for k, v in replies.items()}
        self.calls: list[str] = []

    def chat(self, conversations):
        out = []
        for conv in conversations:
            text = conv[-1]["content"]
            role = "verify" if "is_correct" in text else "extract" if "perception_attrs" in text else "rewrite"
            self.calls.append(role)
            out.append(self.replies[role].pop(0))
        return out


def _batch(rows: list[RawRow]) -> pd.DataFrame:
    frame = _frame(0, rows)
    frame["image"] = [b"png"] * len(rows)  # the load stage ran already
    return frame


def test_llm_stage_turns_bad_replies_into_rejects_with_reasons():
    cfg = PPJDConfig(
        source="jsonl", paths=["x.jsonl"], perturb_backend="llm", vqa_backend="vlm", llm_model="m", vlm_model="v"
    )
    rows = [
        RawRow(
            f"r{i}",
            "jsonl",
            question="How many cats?",
            chosen=CHOSEN,
            answer="" if i < 2 else "2",
            where=f"x.jsonl line {i}",
        )
        for i in range(5)
    ]
    good_attrs = '{"perception_attrs": ["red ball", "two cats", "cats on the left"]}'
    good_rewrite = json.dumps(
        {
            "rejected_perception_1": CHOSEN.replace("red", "blue").replace("2", "3"),
            "rejected_perception_2": CHOSEN.replace("2", "4").replace("left", "right"),
        }
    )
    engine = CannedTextEngine(
        {
            "verify": ["not json at all", '{"is_correct": true}'],  # rows 0, 1 have no ground truth
            "extract": [good_attrs, '{"perception_attrs": ["one"]}', good_attrs, good_attrs],
            "rewrite": [good_rewrite, '{"rejected_perception_1": "x"}', good_rewrite],
        }
    )
    out = LlmStage(cfg, engine=engine)(_batch(rows)).to_dict("records")
    assert list(_batch(rows).columns) == list(WORK_COLUMNS)
    by_id = {r["id"]: r for r in out}
    assert by_id["r0"]["reject_stage"] == "verify" and "not JSON" in by_id["r0"]["reject_reason"]
    assert by_id["r2"]["reject_stage"] == "extract" and "1 perception attributes" in by_id["r2"]["reject_reason"]
    assert by_id["r3"]["reject_stage"] == "perturb" and "missing" in by_id["r3"]["reject_reason"]
    for kept in ("r1", "r4"):
        assert by_id[kept]["reject_stage"] == "", by_id[kept]["reject_reason"]
        levels = json.loads(by_id[kept]["levels"])
        assert [lv["text"] for lv in levels][0] == CHOSEN and len(levels) == 3
        probes = json.loads(by_id[kept]["probes"])
        assert {(p["original"], p["perturbed"]) for p in probes if p["level"] == 1} >= {("red", "blue")}
    # Rejected rows are not sent to later roles.
    assert (
        engine.calls.count("verify") == 2 and engine.calls.count("extract") == 4 and engine.calls.count("rewrite") == 3
    )


def test_llm_stage_lets_bugs_fail_the_job():
    """Only an unusable reply is a row's reject; a reply that is not even a string is a broken
    engine (pjray's bug or the backend's), which must fail the job instead of passing for data."""
    cfg = PPJDConfig(
        source="jsonl", paths=["x.jsonl"], perturb_backend="llm", vqa_backend="vlm", llm_model="m", vlm_model="v"
    )
    rows = [RawRow("r0", "jsonl", question="How many cats?", chosen=CHOSEN, answer="", where="x.jsonl line 0")]
    with pytest.raises(AttributeError):
        LlmStage(cfg, engine=CannedTextEngine({"verify": [None]}))(_batch(rows))
    out = LlmStage(cfg, engine=CannedTextEngine({"verify": ["[1, 2]"]}))(_batch(rows)).to_dict("records")
    assert out[0]["reject_stage"] == "verify" and "expected a JSON object" in out[0]["reject_reason"]
