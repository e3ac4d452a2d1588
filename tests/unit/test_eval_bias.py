"""The Mode a / Mode b diagnosis on scene items with canned judges; reports; the eval config."""

import json

import pytest

from pjray.config import ConfigError, load
from pjray.eval.bias import (
    DiagnosisDataError,
    diagnosis_item,
    evaluate_modes,
    item_prompts,
    probe_correct,
    read_probe_answer,
)
from pjray.eval.report import EvalReport, to_markdown, write_report
from pjray.ppjd.perturb import scene_items
from pjray.types import JudgeItem


@pytest.fixture(scope="module")
def items():
    return scene_items(5, seed=7, image_size=96)


def test_diagnosis_item_from_scene_meta(items):
    for it in items:
        d = diagnosis_item(it)
        levels = it.meta["levels"]
        assert d.correct == it.candidates[it.order[0]] and d.wrong == it.candidates[levels[1]["candidate"]]
        assert d.wrong != d.correct and d.probes
        assert [q for q, _ in d.probes] == [p["question"] for p in levels[1]["probes"]]
        prompts = item_prompts(d)
        assert [p.protocol for p in prompts] == ["score", "score"] + ["vqa"] * len(d.probes)
        assert prompts[2].user == d.probes[0][0] and prompts[2].image == it.image


def test_item_without_probes_is_named():
    bare = JudgeItem("x-1", b"img", "q", ("a", "b"), (0, 1), "mmpr", {})
    with pytest.raises(DiagnosisDataError, match="x-1"):
        diagnosis_item(bare)


def test_probe_answer_reading_and_matching():
    assert read_probe_answer("<think>hm</think><answer> Red </answer>") == "Red"
    assert read_probe_answer("hm</think> top left") == "top left"
    assert read_probe_answer("a long ramble without any answer tag at all here") is None
    assert probe_correct("Red.", "red")
    assert probe_correct("It is red", "red")
    assert probe_correct("the top left", "top left")
    assert not probe_correct("not red", "red")
    assert not probe_correct("blue", "red")
    assert probe_correct("three", "3")  # normalize_answer maps number words


def _judge(anchored: bool, probe_right: bool):
    """A canned judge: scores the correct answer 8 and the wrong one 9 (anchored) or 2."""

    def generate(prompts, seed):
        out = []
        for p in prompts:
            if p.item_id.endswith(":correct"):
                out.append("ok</think><answer>8</answer>")
            elif p.item_id.endswith(":wrong"):
                out.append(f"ok</think><answer>{9 if anchored else 2}</answer>")
            else:
                out.append("ok</think><answer>%s</answer>" % (truths[p.item_id] if probe_right else "zebra"))
        return out

    truths: dict[str, str] = {}
    return generate, truths


@pytest.mark.parametrize(
    "anchored, probe_right, want",
    [(False, True, (0.0, 0.0, 0.0)), (True, True, (1.0, 0.0, 1.0)), (True, False, (1.0, 1.0, 0.0))],
)
def test_evaluate_modes_canned(anchored, probe_right, want):
    cfg = load(overrides=["eval.num_items=5", "eval.image_size=96", "eval.scene_seed=7", "eval.seeds=[0,1]"])
    generate, truths = _judge(anchored, probe_right)
    for it in scene_items(5, seed=7, image_size=96, split=cfg.eval.scene_split):  # the items evaluate_modes builds
        d = diagnosis_item(it)
        for i, (_, answer) in enumerate(d.probes):
            truths[f"{d.id}:probe{i}"] = answer
    report = evaluate_modes(cfg, generate)
    t = report.tables["perceptual_bias"]
    assert (t["error_rate"].value, t["mode_a_rate"].value, t["mode_b_rate"].value) == want
    assert t["probe_accuracy"].value == (1.0 if probe_right else 0.0)
    assert t["error_rate"].per_seed == (want[0], want[0]) and report.unparsed == 0
    assert set(report.tables["error_rate_by_kind"]) <= {"color", "count", "spatial", "size", "existence"}


def test_evaluate_modes_counts_garbage():
    cfg = load(overrides=["eval.num_items=3", "eval.image_size=96"])
    report = evaluate_modes(cfg, lambda prompts, seed: ["@@ garbage"] * len(prompts))
    t = report.tables["perceptual_bias"]
    assert t["error_rate"].value is None and t["error_rate"].n == 0
    assert report.unparsed == report.outputs > 0 and report.unparsed_examples[0] == "@@ garbage"
    md = to_markdown(report)
    assert f"unparseable: {report.outputs} (100.0%)" in md and "n/a" in md


def test_write_report_json_markdown_png(tmp_path):
    cfg = load(overrides=["eval.num_items=2", "eval.image_size=96"])
    report = evaluate_modes(cfg, lambda prompts, seed: ["x</think><answer>5</answer>"] * len(prompts))
    paths = write_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["tables"]["perceptual_bias"]["error_rate"]["value"] == 1.0  # 5 >= 5: ties are errors
    assert paths["bars"].read_bytes()[:4] == b"\x89PNG"
    assert "| error_rate |" in paths["markdown"].read_text()
    assert report.flat_metrics()["eval/perceptual_bias/error_rate"] == 1.0


def test_bias_radar_plot(tmp_path):
    from pjray.eval.metrics import BIAS_TYPES
    from pjray.eval.report import Cell

    report = EvalReport("mm_judgebias", "j", "", [0], {"bias": {t: Cell(0.5, n=1) for t in BIAS_TYPES}}, 18, 0)
    paths = write_report(report, tmp_path)
    assert paths["bias_radar"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "override, key",
    [
        ("eval.bench=vqa", "eval.bench"),
        ("eval.tie_rule=lenient", "eval.tie_rule"),
        ("eval.prompt_format=chat", "eval.prompt_format"),
        ("eval.workers=0", "eval.workers"),
        ("eval.seeds=[]", "eval.seeds"),
        ("eval.bench=pair", "eval.data"),
        ("eval.every_steps=-1", "eval.every_steps"),
    ],
)
def test_eval_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(overrides=[override])


def test_eval_config_combinations():
    with pytest.raises(ConfigError, match="eval.score_mapping"):
        load(overrides=["eval.prompt_format=original", "eval.score_mapping=ceil_half"])
    with pytest.raises(ConfigError, match="eval.train_seed"):
        load(overrides=["eval.every_steps=2", "eval.train_seed=0", "data.seed=0"])
    assert load(overrides=["eval.every_steps=2"]).eval.train_seed != 0
