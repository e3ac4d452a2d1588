"""MLLM-as-a-Judge loaders (both field-name variants), prompts, verdict reading and tables."""

import json
from pathlib import Path

import pytest

from pjray.config import ConfigError, load
from pjray.eval.judge_bench import (
    BenchDataError,
    build_prompt,
    evaluate_bench,
    read_batch,
    read_pair,
    read_rows,
    read_score,
    resolve_score_mapping,
)
from pjray.eval.metrics import OVERALL
from pjray.eval.report import write_report

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mllm_judge"


def test_score_rows_both_variants():
    a = read_rows(FIXTURES / "score.jsonl", "score")
    b = read_rows(FIXTURES / "score_variant.jsonl", "score")
    assert [r.truth for r in a] == ["4", "2", "5", "1"]  # int and "2" both cast
    assert [r.truth for r in b] == ["4", "2"]  # "4" and 2.0
    assert a[0].answers == b[0].answers == ("The chart shows a red bar.",)
    assert a[0].dataset == b[0].dataset == "ChartQA" and a[0].image == b[0].image
    assert a[0].image.startswith(b"\x89PNG")


def test_pair_and_batch_rows_both_variants():
    pair, pair_v = read_rows(FIXTURES / "pair.jsonl", "pair"), read_rows(FIXTURES / "pair_variant.jsonl", "pair")
    assert [r.truth for r in pair] == ["A", "B", "C"] and [r.truth for r in pair_v] == ["A", "C"]  # "Tie" -> C
    assert pair[0].answers == pair_v[0].answers == ("Red.", "Green.")
    batch, batch_v = read_rows(FIXTURES / "batch.jsonl", "batch"), read_rows(FIXTURES / "batch_variant.jsonl", "batch")
    assert batch[0].truth == batch_v[0].truth == "DBCA" and batch[0].answers == batch_v[0].answers
    assert len(batch[1].answers) == 3
    assert len(read_rows(FIXTURES / "batch.jsonl", "batch", limit=1)) == 1


def test_bad_rows_name_file_line_and_key(tmp_path):
    f = tmp_path / "pair.jsonl"
    f.write_text('{"instruction": "q", "original_dataset": "d", "answer1": "a", "answer2": "b"}\n')
    with pytest.raises(BenchDataError, match=r"pair.jsonl line 1: none of the keys \['human_answer', 'human'\]"):
        read_rows(f, "pair")
    f.write_text('{"instruction": "q", "original_dataset": "d", "answer1": "a", "answer2": "b", "human": "D"}\n')
    with pytest.raises(BenchDataError, match="line 1: pair truth 'D'"):
        read_rows(f, "pair")
    f.write_text(
        '{"instruction": "q", "original_dataset": "d", "image_path": "nope.png", "answer1": "a", "answer2": "b", "human": "A"}\n'
    )
    with pytest.raises(BenchDataError, match="image 'nope.png' not found"):
        read_rows(f, "pair")
    b = tmp_path / "batch.jsonl"
    b.write_text('{"instruction": "q", "original_dataset": "d", "answers": ["x", "y", "z"], "human": "ABD"}\n')
    with pytest.raises(BenchDataError, match="batch truth"):
        read_rows(b, "batch")


def test_paper_prompts_keep_benchmark_letters():
    batch = read_rows(FIXTURES / "batch.jsonl", "batch")[0]
    p = build_prompt(batch, "paper", "scores")
    assert p.target == "DBCA" and p.shown == (0, 1, 2, 3) and "<think>" in p.system
    assert p.user.index("Green.") < p.user.index("It is a red bar.")  # stored order, not shuffled
    pair = build_prompt(read_rows(FIXTURES / "pair.jsonl", "pair")[2], "paper")
    assert pair.target == "C" and pair.protocol == "pair"
    score = build_prompt(read_rows(FIXTURES / "score.jsonl", "score")[0], "paper")
    assert score.target == "4" and score.image is not None


def test_original_prompt_layout():
    p = build_prompt(read_rows(FIXTURES / "pair.jsonl", "pair")[0], "original")
    assert p.user.startswith("Please serve as an unbiased judge")
    for section in ("\nEvaluation Steps:\n", "\nEvaluation Method:\n", "\nNotice:\n", "\nHere is the input:\n"):
        assert section in p.user
    assert "[The Start of Assistant A\u2019s Answer]\nRed.\n[The End of Assistant A\u2019s Answer]" in p.user
    assert "[[C]]" in p.user and p.system == ""


def test_reading_verdicts():
    assert read_score("<think>x</think><answer>7</answer>", "paper", "ceil_half") == 4
    assert read_score("<think>x</think><answer>10</answer>", "paper", "none") == 10
    assert read_score("<think>x</think><answer>11</answer>", "paper", "none") is None
    assert read_score("no tags at all", "paper", "ceil_half") is None
    assert read_score('{"Analysis": "ok", "Judgement": "[[4]]"}', "original", "none") == 4
    assert read_score("[[9]]", "original", "none") is None  # outside 1-5
    assert read_pair("<think>x</think><answer>3</answer><answer>5</answer>", "paper") == "B"
    assert read_pair("<think>x</think><answer>5</answer><answer>5</answer>", "paper") == "C"
    assert read_pair("The Judgement is [[A]]", "original") == "A"
    assert read_pair("garbage", "original") is None
    text = "<think>x</think><answer>2</answer><answer>9</answer><answer>4</answer><answer>7</answer>"
    assert read_batch(text, 4, "paper") == "BDCA"
    tied = "<think>x</think><answer>5</answer><answer>5</answer><answer>1</answer>"
    assert read_batch(tied, 3, "paper") == "BAC"  # ties ranked as the downstream code does
    assert read_batch("[[B]], [[A]], [[D]], [[C]]", 4, "original") == "BADC"
    assert read_batch("nothing", 4, "paper") is None


def test_score_mapping_auto():
    assert resolve_score_mapping("paper", "auto") == "ceil_half"
    assert resolve_score_mapping("original", "auto") == "none"
    assert resolve_score_mapping("paper", "none") == "none"


def _canned(texts_by_id):
    def generate(prompts, seed):
        return [texts_by_id.get(p.item_id, "unreadable") for p in prompts]

    return generate


def test_a_bad_line_within_the_allowed_fraction_is_skipped_and_reported(tmp_path):
    lines = (FIXTURES / "pair.jsonl").read_text().splitlines()
    data = tmp_path / "pair.jsonl"
    data.write_text("\n".join([lines[0], "{not json", lines[1], '{"instruction": "q"}', *lines[2:]]) + "\n")
    cfg = load(
        overrides=["eval.bench=pair", f"eval.data={data}", f"eval.image_dir={FIXTURES}", "data.max_reject_fraction=0.5"]
    )
    report = evaluate_bench(cfg, _canned({}))
    assert report.outputs == len(lines)  # every good row judged
    assert [(r.where, r.reason[:8]) for r in report.rejects] == [
        (f"{data} line 2", "not JSON"),
        (f"{data} line 4", "none of "),
    ]
    assert report.flat_metrics()["eval/rejected"] == 2.0
    paths = write_report(report, tmp_path / "out", plots=False)
    assert f"data rows rejected: 2 (listed in rejects.jsonl), e.g. `{data} line 2`" in paths["markdown"].read_text()
    listed = [json.loads(x) for x in paths["rejects"].read_text().splitlines()]
    assert [r["where"] for r in listed] == [f"{data} line 2", f"{data} line 4"]
    with pytest.raises(BenchDataError, match=r"2 of 5 rows are bad \(more than data.max_reject_fraction=0.25\)"):
        evaluate_bench(
            load(
                overrides=[
                    "eval.bench=pair",
                    f"eval.data={data}",
                    f"eval.image_dir={FIXTURES}",
                    "data.max_reject_fraction=0.25",
                ]
            ),
            _canned({}),
        )


def test_evaluate_pair_with_canned_judge():
    cfg = load(overrides=["eval.bench=pair", f"eval.data={FIXTURES / 'pair.jsonl'}", "eval.seeds=[0,1]"])
    answers = {
        "pair-0": "<think>x</think><answer>8</answer><answer>2</answer>",  # A: right
        "pair-1": "<think>x</think><answer>4</answer><answer>4</answer>",  # predicted tie, truth B
        # pair-2 (true tie): unreadable
    }
    report = evaluate_bench(cfg, _canned(answers))
    with_tie, without = report.tables["acc_with_tie"], report.tables["acc_without_tie"]
    assert with_tie[OVERALL].value == pytest.approx(1 / 3)
    assert without[OVERALL].value == pytest.approx(1.0)  # official: pair-1 (pred C) and pair-2 (true C) skipped
    assert without["ChartQA"].per_seed == (1.0, 1.0) and without["coco"].value is None
    assert report.outputs == 6 and report.unparsed == 2 and report.unparsed_examples == ["unreadable"] * 2
    cfg = load(overrides=["eval.bench=pair", f"eval.data={FIXTURES / 'pair.jsonl'}", "eval.tie_rule=downstream"])
    report = evaluate_bench(cfg, _canned(answers))
    assert report.tables["acc_without_tie"][OVERALL].value == pytest.approx(0.5)  # pair-1 counted wrong


def test_evaluate_score_and_batch_with_canned_judge():
    cfg = load(overrides=["eval.bench=score", f"eval.data={FIXTURES / 'score.jsonl'}"])
    answers = {f"score-{i}": f"<think>x</think><answer>{s}</answer>" for i, s in enumerate((8, 3, 10, 1))}
    report = evaluate_bench(cfg, _canned(answers))
    # ceil(v/2): (4, 2, 5, 1) == human (4, 2, 5, 1): r = 1 per dataset and pooled
    assert report.tables["pearson"][OVERALL].value == pytest.approx(1.0)
    assert report.tables["pearson"]["ChartQA"].value == pytest.approx(1.0)
    assert report.unparsed == 0
    cfg = load(overrides=["eval.bench=batch", f"eval.data={FIXTURES / 'batch.jsonl'}"])
    answers = {"batch-1": "<think>x</think><answer>1</answer><answer>3</answer><answer>2</answer><answer>4</answer>"}
    report = evaluate_bench(cfg, _canned(answers))
    # batch-1: pred DBCA == truth; batch-2 unreadable: raw 3, normalised 1
    assert report.tables["levenshtein_raw"]["ChartQA"].value == 0
    assert report.tables["levenshtein_raw"][OVERALL].value == pytest.approx(1.5)
    assert report.tables["levenshtein_norm"][OVERALL].value == pytest.approx(0.5)
    assert report.unparsed == 1


# --------------------------------------------------------------------------- downstream conventions


@pytest.mark.parametrize("key", ["pair_vote", "unparsed_score", "convention", "bias_convention"])
def test_convention_keys_are_validated(key):
    with pytest.raises(ConfigError, match=rf"eval\.{key}='bogus'"):
        load(overrides=[f"eval.{key}=bogus"])
    e = load().eval
    assert (e.pair_vote, e.unparsed_score, e.convention, e.bias_convention) == ("none", "drop", "strict", "official")


@pytest.mark.parametrize(
    "override",
    [
        "eval.seed_agg=median",
        "eval.tie_rule=downstream",
        "eval.pair_vote=majority",
        "eval.unparsed_score=minus_one",
        "eval.prompt_format=original",
        "eval.batch_style=ranking",
        "eval.score_mapping=none",
    ],
)
def test_release_conventions_fix_their_own_rules(override):
    base = ["eval.bench=pair", "eval.data=x.jsonl"]
    key = override.split("=")[0]
    for convention in ("perception_judge", "flex_judge"):
        with pytest.raises(ConfigError, match=rf"{key.replace('.', chr(92) + '.')}=.*eval\.convention=strict"):
            load(overrides=base + [f"eval.convention={convention}", override])
    assert load(overrides=base + [override]).eval.convention == "strict"


def test_conventions_belong_to_their_benches():
    with pytest.raises(ConfigError, match="eval.convention=flex_judge: only for eval.bench=score, pair or batch"):
        load(overrides=["eval.bench=mm_judgebias", "eval.convention=flex_judge"])
    with pytest.raises(ConfigError, match="eval.bias_convention=strict: only for eval.bench=mm_judgebias"):
        load(overrides=["eval.bench=pair", "eval.data=x.jsonl", "eval.bias_convention=strict"])
    assert load(overrides=["eval.bench=batch", "eval.data=x.jsonl", "eval.convention=perception_judge"])


def test_evaluate_pair_majority_vote():
    verdicts = {  # per seed: pair-0 (truth A), pair-1 (truth B), pair-2 (truth C, coco)
        0: ("A", "B", "A"),
        1: ("B", "B", "C"),
        2: ("A", "A", None),
    }
    text = {
        "A": "<answer>8</answer><answer>2</answer>",
        "B": "<answer>2</answer><answer>8</answer>",
        "C": "<answer>4</answer><answer>4</answer>",
        None: "unreadable",
    }

    def generate(prompts, seed):
        return ["<think>x</think>" + text[verdicts[seed][int(p.item_id.split("-")[1])]] for p in prompts]

    over = ["eval.bench=pair", f"eval.data={FIXTURES / 'pair.jsonl'}", "eval.seeds=[0,1,2]"]
    per_seed = evaluate_bench(load(overrides=over), generate)
    # per seed with ties: 2/3, 2/3, 1/3
    assert per_seed.tables["acc_with_tie"][OVERALL].per_seed == pytest.approx((2 / 3, 2 / 3, 1 / 3))
    voted = evaluate_bench(load(overrides=over + ["eval.pair_vote=majority"]), generate)
    # voted: pair-0 A,B,A -> A right; pair-1 B,B,A -> B right; pair-2 A,C,None tied -> A (seed 0), wrong
    cell = voted.tables["acc_with_tie"][OVERALL]
    assert cell.value == pytest.approx(2 / 3) and cell.per_seed == pytest.approx((2 / 3,)) and cell.n == 3
    assert voted.tables["acc_without_tie"][OVERALL].value == 1.0  # pair-2 (true tie) skipped
    assert voted.outputs == 9 and voted.unparsed == 1
    assert "plurality over the 3 seeds (pjray" in voted.sources["acc_with_tie"]


def test_evaluate_score_unparsed_minus_one():
    answers = {
        f"score-{i}": f"<think>x</think><answer>{s}</answer>" for i, s in enumerate((8, 3, 10))
    }  # score-3 unreadable
    over = ["eval.bench=score", f"eval.data={FIXTURES / 'score.jsonl'}"]
    dropped = evaluate_bench(load(overrides=over), _canned(answers)).tables["pearson"][OVERALL]
    assert dropped.value == pytest.approx(1.0) and dropped.n == 3 and dropped.unparsed == 1
    kept = evaluate_bench(load(overrides=over + ["eval.unparsed_score=minus_one"]), _canned(answers)).tables["pearson"][
        OVERALL
    ]
    # pred (4, 2, 5, -1) vs human (4, 2, 5, 1): dx = (1.5, -.5, 2.5, -3.5), dy = (1, -1, 2, -2)
    # sum dx*dy = 14, sum dx^2 = 21, sum dy^2 = 10 -> r = 14 / sqrt(210)
    assert kept.value == pytest.approx(14 / 210**0.5) and kept.n == 4 and kept.unparsed == 1


def test_evaluate_batch_perception_judge(tmp_path):
    data = tmp_path / "batch.jsonl"
    data.write_text(
        '{"id": 1, "instruction": "q", "original_dataset": "d", "answers": ["a", "b", "c", "d"], "human": "DBCA"}\n'
        '{"id": 2, "instruction": "q", "original_dataset": "d", "answers": ["a", "b"], "human": "BA"}\n'
    )
    answers = {
        "batch-1": "<think>x</think>" + "".join(f"<answer>{s}</answer>" for s in (1, 3, 2, 4, 9)),  # 5 scores for 4
        "batch-2": "<think>x</think><answer>2</answer><answer>8</answer>",  # BA: right
    }
    over = ["eval.bench=batch", f"eval.data={data}"]
    strict = evaluate_bench(load(overrides=over), _canned(answers))
    # batch-1 unreadable (5 scores): raw 4; batch-2: 0
    assert strict.tables["levenshtein_raw"][OVERALL].value == pytest.approx(2.0) and strict.unparsed == 1
    pj = evaluate_bench(load(overrides=over + ["eval.convention=perception_judge"]), _canned(answers))
    # batch-1: the first 4 scores (1, 3, 2, 4) -> DBCA == truth; batch-2 skipped (2 answers)
    assert set(pj.tables) == {"levenshtein_norm"}  # the notebook computes the normalised distance only
    norm = pj.tables["levenshtein_norm"][OVERALL]
    assert norm.value == 0 and norm.n == 1 and norm.skipped == 1 and pj.unparsed == 0
    assert any("1 item(s) with <= 2 answers skipped" in n for n in pj.notes)
    assert pj.convention.startswith("perception_judge") and "evaluate_metric.ipynb" in pj.sources["levenshtein_norm"]
