"""`pjray eval` end to end: a tiny random judge on CPU, judged through Ray RolloutWorkers.

The tiny judge writes garbage; the point is that the pipeline runs, unreadable outputs are
counted and reported, and a rerun takes every output from the cache.
"""

import json
from pathlib import Path

import pytest
import ray

from pjray.cli import main
from pjray.models.tiny import build_tiny_judge

pytestmark = pytest.mark.slow  # about 75 s on 2 cores: Ray start-up and five judge launches

FIXTURES = Path(__file__).parents[1] / "fixtures"
COMMON = ["eval.max_new_tokens=8", "eval.num_cpus_per_worker=0.5", "ray.num_cpus=2", "eval.plots=true"]


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    path = build_tiny_judge(tmp_path_factory.mktemp("tiny_judge"), seed=0)
    yield str(path)
    if ray.is_initialized():
        ray.shutdown()


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_pair_bench_end_to_end_and_cache(judge, tmp_path, capsys):
    out = tmp_path / "pair"
    args = [
        "eval",
        "--judge",
        judge,
        "--bench",
        "pair",
        "--data",
        str(FIXTURES / "mllm_judge" / "pair.jsonl"),
        "--output-dir",
        str(out),
        "eval.seeds=[0,1]",
        *COMMON,
    ]
    assert main(args) == 0
    report = _report(out)
    assert report["outputs"] == 6 and report["cache_hits"] == 0
    assert 0 <= report["unparsed"] <= 6
    assert set(report["tables"]) == {"acc_with_tie", "acc_without_tie"}
    assert {"ChartQA", "coco", "overall", "dataset_mean"} <= set(report["tables"]["acc_with_tie"])
    assert (out / "report.md").exists() and (out / "bars.png").read_bytes()[:4] == b"\x89PNG"
    assert "unparseable" in capsys.readouterr().out
    assert len((out / "cache.jsonl").read_text().splitlines()) == 6

    # A rerun judges nothing: every output comes from the cache, and the numbers are the same.
    assert main(args) == 0
    again = _report(out)
    assert again["cache_hits"] == 6 and again["tables"] == report["tables"]
    assert len((out / "cache.jsonl").read_text().splitlines()) == 6

    # One more seed: only its 3 outputs are judged.
    assert main([*args, "eval.seeds=[0,1,2]"]) == 0
    assert _report(out)["cache_hits"] == 6
    assert len((out / "cache.jsonl").read_text().splitlines()) == 9


def test_vl_rewardbench_blind_twin_judge_vs_judge_and_rescoring(judge, tmp_path):
    """The official prompt through the judge actors, the mismatched pass and its paired test, a
    second judge compared on the same rows, and the run's own outputs scored again without Ray."""
    from tests.support.preference import write_vlrb

    data = write_vlrb(tmp_path / "vlrb")
    other = build_tiny_judge(tmp_path / "other_judge", seed=1)
    out = tmp_path / "vlrb_run"
    assert (
        main(
            [
                "eval",
                "--judge",
                judge,
                "--bench",
                "vl_rewardbench",
                "--data",
                str(data),
                "--output-dir",
                str(out),
                "eval.blind=[mismatched]",
                f"eval.compare=[{other}]",
                *COMMON,
            ]
        )
        == 0
    )
    first = out / f"0_{Path(judge).stem}"
    report = _report(first)
    assert report["outputs"] == 8 and set(report["tables"]) == {"official_k1", "strict"}
    assert {"general", "hallucination", "reasoning", "overall", "macro"} <= set(report["tables"]["strict"])
    assert report["paired"]["real vs mismatched"][-1]["n"] == 8
    assert len((first / "outputs.mismatched.jsonl").read_text().splitlines()) == 8
    compare = json.loads((out / "compare.json").read_text())
    assert compare["judges"] == [judge, str(other)] and compare["paired"][0]["tests"][-1]["n"] == 8

    rescored = tmp_path / "rescored"
    assert (
        main(
            [
                "eval",
                "--bench",
                "vl_rewardbench",
                "--data",
                str(data),
                "--output-dir",
                str(rescored),
                f"eval.outputs={first / 'outputs.jsonl'}",
                "eval.plots=false",
            ]
        )
        == 0
    )
    assert _report(rescored)["tables"] == report["tables"]


def test_perceptual_bias_and_mm_judgebias_on_scenes(judge, tmp_path):
    out = tmp_path / "modes"
    assert (
        main(
            [
                "eval",
                "--judge",
                judge,
                "--bench",
                "perceptual_bias",
                "--output-dir",
                str(out),
                "eval.num_items=3",
                "eval.image_size=64",
                *COMMON,
            ]
        )
        == 0
    )
    report = _report(out)
    assert report["outputs"] >= 9 and set(report["tables"]["perceptual_bias"]) >= {
        "error_rate",
        "mode_a_rate",
        "mode_b_rate",
    }
    out = tmp_path / "mmjb"
    assert (
        main(
            [
                "eval",
                "--judge",
                judge,
                "--bench",
                "mm_judgebias",
                "--output-dir",
                str(out),
                "eval.num_items=2",
                "eval.image_size=64",
                *COMMON,
            ]
        )
        == 0
    )
    report = _report(out)
    assert report["outputs"] == 2 * 9 * 2
    assert "text_dominance" in report["tables"]["bias"] and (out / "bias_radar.png").exists()


def test_missing_judge_is_a_config_error(tmp_path, capsys):
    assert main(["eval", "--bench", "perceptual_bias", "--output-dir", str(tmp_path)]) == 2
    assert "eval.judge" in capsys.readouterr().err


def test_training_eval_through_a_rollout_pool(judge):
    """The trainer's held-out eval: the rollout pool judges held-out scenes, eval/* metrics out."""
    from pjray.cluster import connect
    from pjray.config import load
    from pjray.eval.bias import training_eval
    from pjray.placement import Placement, RoleResources, WorkerPool
    from pjray.rollout.worker import RolloutWorker, generate_with_pool

    cfg = load(
        overrides=[
            "model.init=tiny",
            "eval.every_steps=1",
            "eval.train_num_items=2",
            "data.image_size=64",
            "rollout.max_new_tokens=8",
            "ray.num_cpus=2",
        ]
    )
    connect(cfg.ray)
    placement = Placement({"rollout": RoleResources(1, 0.5, 0.0)}, strategy="PACK")
    pool = WorkerPool(placement, "rollout", RolloutWorker, lambda i: (judge, cfg.model, cfg.rollout, i), max_retries=1)
    try:
        # What the trainer hands its evaluation hook: the rollout pool as a generate function.
        metrics = training_eval(
            cfg, lambda prompts, seed: [c.text for c in generate_with_pool(pool, prompts, 1, seed).value], 3
        )
    finally:
        pool.shutdown()
        placement.shutdown()
    assert metrics["eval/n"] + metrics["eval/unparsed_scores"] == 2
    assert all(k.startswith("eval/") for k in metrics)
    assert {"eval/error_rate", "eval/mode_a_rate", "eval/mode_b_rate"} <= set(metrics)  # nan if undefined


def test_looking_bench_on_the_shipped_base_judge(tmp_path):
    """The looking protocol through the judge pool: the shipped base judge (one disposition)
    judges by the image on its own, writes no disposition sentence, and its forced run (its own
    "Image: X." kept, nothing more: eval.force_disposition=false, the default) is its plain run;
    the forced prompts (a prefill) never share a cached output with the plain ones."""
    import pyarrow.parquet as pq

    from pjray.recipes.base_judge import SHIPPED

    out = tmp_path / "looking"
    args = [
        "eval",
        "--config",
        str(Path(__file__).parents[2] / "configs" / "eval_looking.yaml"),
        "--judge",
        str(SHIPPED / "hf_model"),
        "--output-dir",
        str(out),
        "eval.num_items=24",
        "eval.num_cpus_per_worker=0.5",
        "ray.num_cpus=2",
    ]
    assert main(args) == 0
    report = _report(out)
    tables = report["tables"]
    following = tables["image_following"]["pooled"]["value"]
    assert following >= 0.5 and tables["disposition_image"]["pooled"]["value"] == 0.0, tables["image_following"]
    assert tables["forced_image_following"]["pooled"]["value"] == following, tables["forced_image_following"]
    assert tables["correct_first"]["pooled"]["value"] > 0.5, tables["correct_first"]  # a third keeps the order shown
    assert set(tables["image_following"]) == {"pooled", "color", "size"}
    assert report["outputs"] == 24 * 6 and report["unparsed"] == 0
    assert pq.read_metadata(out / "looking_items.parquet").num_rows == 24
    assert len((out / "cache.jsonl").read_text().splitlines()) == 24 * 6
    assert main(args) == 0 and _report(out)["cache_hits"] == 24 * 6
