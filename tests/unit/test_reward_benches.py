"""VL-RewardBench and Multimodal RewardBench: readers of both published layouts, the official
prompts, the official readings and scorings against re-derivations of `cal.py` and
`2_get_accuracy.py` on the official answers-file layout, outputs produced elsewhere, the blind
twin (mismatched images) and the judge-vs-judge paired tests."""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from pathlib import Path

import pytest

from pjray.config import ConfigError, load
from pjray.eval import mm_rewardbench, vl_rewardbench
from pjray.eval.blind import mismatched_images
from pjray.eval.metrics import OVERALL, mcnemar_exact, paired_test
from pjray.eval.preference import PreferenceDataError, Sample, preferred_slot
from pjray.eval.report import write_report
from pjray.eval.reward_bench import judge_prompt, scan_rows
from pjray.eval.runner import evaluate, run_eval
from tests.support.preference import MMRB_ROWS, VLRB_IDS, write_mmrb, write_vlrb

# --------------------------------------------------------------------------- re-derived official scripts


def cal_py(lines: list[dict], k: int, rng: random.Random) -> dict:
    """VL-RewardBench `cal.py` on an answers file (its `distribution(reparse=True)`, `classify`,
    `distribution_dataset`) for one k, shuffling with `rng` (the script's module generator,
    seeded 1234 once before its k loop). Returns group -> (agree, decided) and the summary."""
    data = list(lines)
    for i in range(len(data)):
        j = rng.randint(0, len(data) - 1)
        data[i], data[j] = data[j], data[i]
    dist: dict[str, dict] = {}
    for item in data:
        key = item["id"] + item["query"] + "\t".join(sorted(item["response"]))
        random_number = item["meta"]["random_number"]
        rejected = item["ranking"].index(1 if random_number == 0 else 0) + 1
        text = item["meta"]["filter_choice"].replace("\n", "").replace("*", "")
        match = re.search(
            r"(?:Overall Judgment|Therefore)\s*.*\s*-*\s*Answer\s*(\d+)\s*is\s*(?:the\s*)?(?:slightly\s*)?better",
            text,
            re.IGNORECASE,
        )
        status = "doesntMatch" if not match else ("reject" if int(match.group(1)) == rejected else "agree")
        d = dist.setdefault(
            key, {"agree": 0, "reject": 0, "doesntMatch": 0, "dataset": vl_rewardbench.source_dataset(item["id"])}
        )
        if d["agree"] + d["reject"] + d["doesntMatch"] >= k:
            continue
        d[status] += 1
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    group_of = {
        "vlfeedback": "general",
        "wildvision-battle": "general",
        "povid": "hallucination",
        "rlaif-v": "hallucination",
        "rlhf-v": "hallucination",
        "reasoning_tasks": "reasoning",
    }
    for d in dist.values():
        total = d["agree"] + d["reject"] + d["doesntMatch"]
        g = groups[group_of[d["dataset"]]]
        if d["agree"] > total / 2:
            g[0] += 1
            g[1] += 1
        elif d["reject"] > total / 2:
            g[1] += 1
    acc = {name: g[0] / g[1] for name, g in groups.items() if g[1]}
    overall = sum(g[0] for g in groups.values()) / sum(g[1] for g in groups.values())
    groups_ = ("general", "hallucination", "reasoning")  # the script divides by zero where one has nothing decided
    return {**acc, "overall": overall, "macro": sum(acc[g] for g in groups_) / 3 if set(groups_) <= set(acc) else None}


def get_accuracy(lines: list[dict]) -> dict:
    """Multimodal RewardBench `2_get_accuracy.py` on an answers file."""
    rng = random.Random(123)
    accs: dict[str, list[int]] = defaultdict(list)
    for ex in lines:
        out = ex["output"]
        pred = "A" if "[[A]]" in out else "B" if "[[B]]" in out else ("A" if rng.random() < 0.5 else "B")
        acc = int(pred == ex["Label"])
        accs["all"].append(acc)
        category = ex["Meta"]["Category"]
        if category == "safety":
            category = "safety/bias" if ex["ID"].lower().startswith("pairs") else "safety/toxicity"
        elif category == "reasoning":
            category = "reasoning/math" if ex["ID"].lower().startswith("math") else "reasoning/coding"
        accs[category].append(acc)
    return {task: sum(v) / len(v) for task, v in accs.items()}


VERDICTS = [
    "Overall Judgment: Answer 1 is better.",
    "**Overall Judgment**: Answer 2 is slightly better",
    "Overall Judgment:\nAnswer 3 is better",
    "Therefore, Answer 2 is the better one.",
    "Answer 1 is clearly better",
    "",
    "Overall Judgment: Answer 2 is clearly better",
    "overall judgment - answer 1 is better",
]


def random_vlrb_samples(rows, rng: random.Random, per_row: int) -> list[Sample]:
    return [Sample(r.index, rng.choice(VERDICTS), rng.random() < 0.5) for r in rows for _ in range(per_row)]


def official_vlrb_lines(rows, samples: list[Sample]) -> list[dict]:
    by_row = {r.index: r for r in rows}
    lines = []
    for s in samples:
        r = by_row[s.row]
        ranking = [0, 1] if r.better == 0 else [1, 0]
        lines.append(
            {
                "id": r.id,
                "query": r.query,
                "response": list(r.responses),
                "ranking": ranking,
                "meta": {"random_number": int(s.swapped), "filter_choice": s.output},
            }
        )
    return lines


@pytest.fixture
def vlrb_rows(tmp_path):
    return scan_rows(vl_rewardbench, write_vlrb(tmp_path / "vlrb")).rows


@pytest.fixture
def mmrb_rows(tmp_path):
    return scan_rows(mm_rewardbench, write_mmrb(tmp_path / "mmrb")).rows


# --------------------------------------------------------------------------- VL-RewardBench


@pytest.mark.parametrize(
    "text, official, strict",
    [
        ("Overall Judgment: Answer 1 is better.", 1, 1),
        ("**Overall Judgment**: Answer 2 is slightly better", 2, 2),
        ("Overall Judgment:\nAnswer 3 is better", 3, None),  # cal.py: any N but the rejected slot agrees
        ("Therefore, Answer 2 is the better one.", 2, 2),
        ("Answer 1 is clearly better", None, None),  # no "Overall Judgment" / "Therefore"
        ("Overall Judgment: Answer 2 is clearly better", None, None),
        ("", None, None),
        ("Overall Judgment: Answer 1 is better. Later: Answer 2 is better", 2, 2),  # the last after the first keyword
    ],
)
def test_vlrb_reading(text, official, strict):
    assert vl_rewardbench.official_choice(text) == official
    assert vl_rewardbench.strict_choice(text) == strict


def test_vlrb_groups_from_the_id_prefix():
    expected = [
        "general",
        "general",
        "hallucination",
        "hallucination",
        "hallucination",
        "reasoning",
        "reasoning",
        "hallucination",
    ]
    assert [vl_rewardbench.group_of(i) for i in VLRB_IDS] == expected
    assert vl_rewardbench.group_of("anything") == "general"  # cal.py: any other prefix is vlfeedback


@pytest.mark.parametrize("layout", ["parquet", "jsonl"])
def test_vlrb_reads_both_published_layouts(tmp_path, layout):
    rows = scan_rows(vl_rewardbench, write_vlrb(tmp_path, layout)).rows
    assert [r.index for r in rows] == list(range(len(VLRB_IDS)))
    assert [r.id for r in rows] == list(VLRB_IDS)  # the repeated id is two rows, keyed by index
    assert len({r.key for r in rows}) == len(rows)  # different queries: two items for cal.py too
    assert all(r.image and r.image.startswith(b"\x89PNG") for r in rows)
    assert [r.better for r in rows[:3]] == [0, 0, 1]
    assert rows[2].responses[rows[2].better].startswith("good")


def test_both_read_a_dataset_folder(tmp_path):
    """eval.data as a folder of data files goes through `datasets` (as a hub id does)."""
    from pjray.data.hf import eval_source

    for bench, writer, layout in ((vl_rewardbench, write_vlrb, "parquet"), (mm_rewardbench, write_mmrb, "parquet")):
        folder = writer(tmp_path / bench.NAME, layout).parent
        e = load(overrides=[f"eval.bench={bench.NAME}", f"eval.data={folder}"]).eval
        from_folder = scan_rows(bench, eval_source(e)).rows
        from_file = scan_rows(bench, next(folder.glob("*.parquet"))).rows
        assert [(r.id, r.better, r.group, r.image) for r in from_folder] == [
            (r.id, r.better, r.group, r.image) for r in from_file
        ]


def test_vlrb_bad_rows_are_rejects_with_reasons(tmp_path):
    path = tmp_path / "data.jsonl"
    (tmp_path / "a.png").write_bytes(b"png")
    good = {"id": "x_1", "query": "q", "response": ["a", "b"], "human_ranking": [0, 1], "image_path": "a.png"}
    lines = [
        good,
        {**good, "human_ranking": [0, 0]},
        {**good, "response": ["a"]},
        {**good, "image_path": "missing.png"},
        {k: v for k, v in good.items() if k != "query"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    scanned = scan_rows(vl_rewardbench, path)
    assert len(scanned.rows) == 1
    reasons = [r.reason for r in scanned.rejects]
    assert any("human_ranking" in r for r in reasons) and any("list of 2" in r for r in reasons)
    assert any("missing.png" in r for r in reasons) and any("query" in r for r in reasons)
    assert any("not JSON" in r for r in reasons)


@pytest.mark.parametrize("per_row", [1, 3, 10])
def test_vlrb_official_scoring_equals_cal_py(vlrb_rows, per_row):
    samples = random_vlrb_samples(vlrb_rows, random.Random(per_row), per_row)
    tables, _, _ = vl_rewardbench.official_tables(vlrb_rows, samples, "original")
    rng = random.Random(1234)  # cal.py: seeded once, before its loop over k
    for k in vl_rewardbench.KS:
        want = cal_py(official_vlrb_lines(vlrb_rows, samples), k, rng)
        if f"official_k{k}" not in tables:
            assert k > per_row
            continue
        got = tables[f"official_k{k}"]
        for name, value in want.items():
            assert got[name].value == (None if value is None else pytest.approx(value)), (k, name)


def test_vlrb_unparsed_and_no_majority_leave_the_denominators(vlrb_rows):
    rows = vlrb_rows[:3]  # general x2, hallucination; no reasoning row
    right = lambda r: f"Overall Judgment: Answer {preferred_slot(r, False)} is better"  # noqa: E731
    samples = [
        Sample(rows[0].index, right(rows[0]), False),
        Sample(rows[1].index, "no verdict", False),
        Sample(rows[2].index, right(rows[2]), False),
    ]
    tables, _, notes = vl_rewardbench.official_tables(rows, samples, "original")
    t = tables["official_k1"]
    assert t["general"].value == 1.0 and t["general"].n == 1 and t["general"].unparsed == 1
    assert t[OVERALL].value == 1.0 and t[OVERALL].n == 2
    assert t["reasoning"].value is None and t["macro"].value is None  # the official script divides by zero here
    assert any("reasoning" in n for n in notes)
    # A 2-2 split of 4 samples has no strict majority: neither decided nor unparsed.
    tie = [Sample(rows[0].index, right(rows[0]), False)] * 2 + [
        Sample(rows[0].index, f"Overall Judgment: Answer {3 - preferred_slot(rows[0], False)} is better", False)
    ] * 2
    tables = vl_rewardbench.official_tables(rows[:1], tie, "original")[0]
    assert tables["official_k3"]["general"].n == 1  # k = 3 of the 4 lines: 2 of a kind, decided
    assert "official_k5" not in tables  # no row has 5 samples
    votes = vl_rewardbench.votes(rows[:1], tie)[5]  # all 4 lines counted: 2 against 2
    assert votes[rows[0].key].outcome() == "other"
    assert (
        vl_rewardbench.vote_table(votes)["general"].skipped == 1 and vl_rewardbench.vote_table(votes)["general"].n == 0
    )


def test_vlrb_official_prompt_and_order(vlrb_rows):
    row = vlrb_rows[0]
    text = vl_rewardbench.official_prompt(row, swapped=True)
    assert text.startswith(" You are a highly capable multimodal AI assistant")
    assert f"Answer 1: {row.responses[1]}\n\nAnswer 2: {row.responses[0]}" in text
    assert text.endswith("visual and textual elements of the task.")
    prompt = judge_prompt(vl_rewardbench, row, True, "original")
    assert prompt.system == "" and prompt.image == row.image and prompt.target == "B"  # response[0] shown second
    orders = [vl_rewardbench.swapped(r, seed) for r in vlrb_rows for seed in range(10)]
    assert 20 < sum(orders) < 60 and orders == [vl_rewardbench.swapped(r, s) for r in vlrb_rows for s in range(10)]


# --------------------------------------------------------------------------- Multimodal RewardBench


@pytest.mark.parametrize("layout", ["json", "jsonl", "parquet"])
def test_mmrb_reads_the_published_layouts(tmp_path, layout):
    rows = scan_rows(mm_rewardbench, write_mmrb(tmp_path, layout)).rows
    assert [r.group for r in rows] == [
        "open_generation/correctness_task",
        "open_generation/preference_task",
        "knowledge",
        "reasoning/math",
        "reasoning/coding",
        "safety/bias",
        "safety/toxicity",
        "vqa",
    ]
    assert [r.better for r in rows[:2]] == [1, 0] and all(r.image for r in rows)


def test_mmrb_reading():
    assert mm_rewardbench.official_choice("first [[B]] then [[A]]") == 1  # [[A]] anywhere wins
    assert mm_rewardbench.strict_choice("first [[B]] then [[A]]") == 1
    assert mm_rewardbench.strict_choice("format: [[A]]. My verdict: [[B]]") == 2  # the last
    assert mm_rewardbench.official_choice("A is better") is None and mm_rewardbench.strict_choice("") is None


def test_mmrb_official_scoring_equals_get_accuracy(mmrb_rows):
    rng = random.Random(7)
    outputs = ["[[A]]", "[[B]]", "no verdict", "", "[[B]] ... [[A]]", "A"]
    samples = [Sample(r.index, rng.choice(outputs), False) for r in mmrb_rows for _ in range(3)]  # row by row
    tables, _, _ = mm_rewardbench.official_tables(mmrb_rows, samples, "original")
    per_file = []
    for i in range(3):  # answers file i holds sample i of every row, in row order
        lines = [
            {
                "ID": r.id,
                "Label": "AB"[r.better],
                "output": samples[3 * r.index + i].output,
                "Meta": {"Category": MMRB_ROWS[r.index][1]},
            }
            for r in mmrb_rows
        ]
        per_file.append(get_accuracy(lines))
    for name, cell in tables["official"].items():
        key = "all" if name == OVERALL else name
        assert cell.value == pytest.approx(sum(f[key] for f in per_file) / 3), name
        assert cell.per_seed == pytest.approx(tuple(f[key] for f in per_file))
    assert "official_swapped_order" not in tables


def test_mmrb_prompt_is_the_inference_scripts(mmrb_rows):
    row = mmrb_rows[0]
    text = mm_rewardbench.official_prompt(row, swapped=False)
    assert text.startswith("Please act as an impartial judge and evaluate the quality of the responses")
    assert f"[User Question]\n{row.query}\n\n[The Start of Assistant A's Answer]\n{row.responses[0]}\n" in text
    assert '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better.\n\n[User Question]' in text


# --------------------------------------------------------------------------- runs, outputs, blind twin


class LookingJudge:
    """A judge that is right exactly when the image is its row's own (it knows each row's image),
    and prefers the first answer otherwise; `writes` renders its verdict per benchmark."""

    def __init__(self, rows, bench: str, looks: bool = True):
        self.image_row = {r.image: r for r in rows}
        self.bench, self.looks = bench, looks
        self.calls = 0

    def __call__(self, prompts, seed):
        self.calls += 1
        out = []
        for p in prompts:
            index = int(p.item_id.rsplit("-", 1)[1])
            own = self.image_row.get(p.image)
            right = own is not None and own.index == index if self.looks else True
            slot = "AB".index(p.target) + 1 if right else 3 - ("AB".index(p.target) + 1)
            out.append(
                f"Overall Judgment: Answer {slot} is better"
                if self.bench == "vl_rewardbench"
                else f"[[{'AB'[slot - 1]}]]"
            )
        return out


def cfg_for(bench: str, data: Path, out: Path, *extra: str):
    return load(
        overrides=[
            f"eval.bench={bench}",
            f"eval.data={data}",
            f"eval.output_dir={out}",
            "eval.judge=some/judge",
            *extra,
        ]
    )


@pytest.mark.parametrize("bench, writer", [("vl_rewardbench", write_vlrb), ("mm_rewardbench", write_mmrb)])
def test_blind_twin_and_outputs_round_trip(tmp_path, bench, writer):
    data = writer(tmp_path / "data")
    cfg = cfg_for(bench, data, tmp_path / "run", "eval.seeds=[0,1,2]", "eval.blind=[mismatched]")
    rows = scan_rows(vl_rewardbench if bench == "vl_rewardbench" else mm_rewardbench, data).rows
    report = evaluate(cfg, LookingJudge(rows, bench))
    assert report.tables["strict"][OVERALL].value == 1.0
    assert report.blind["mismatched"].tables["strict"][OVERALL].value == 0.0
    paired = {t["group"]: t for t in report.paired["real vs mismatched"]}
    assert paired[OVERALL]["b"] == len(rows) and paired[OVERALL]["c"] == 0
    assert paired[OVERALL]["p_value"] == pytest.approx(mcnemar_exact(len(rows), 0))
    official = "official_k3" if bench == "vl_rewardbench" else "official"
    assert report.tables[official][OVERALL].value == 1.0
    paths = write_report(report, tmp_path / "run", plots=False)
    lines = [json.loads(x) for x in paths["outputs"].read_text().splitlines()]
    assert len(lines) == 3 * len(rows) and [x["row"] for x in lines[:3]] == [0, 0, 0]  # row by row, samples together
    assert "samples" not in json.loads(paths["json"].read_text())
    assert paths["outputs.mismatched"].exists() and paths["items"].exists()

    # The run's own outputs, scored again without a judge: the same numbers.
    again = evaluate(
        load(overrides=[f"eval.bench={bench}", f"eval.data={data}", f"eval.outputs={paths['outputs']}"]), None
    )
    for table in report.tables:
        assert {k: c.value for k, c in again.tables[table].items()} == {
            k: c.value for k, c in report.tables[table].items()
        }


def test_a_judge_that_does_not_look_shows_no_gap(tmp_path):
    data = write_vlrb(tmp_path / "data")
    rows = scan_rows(vl_rewardbench, data).rows
    report = evaluate(
        cfg_for("vl_rewardbench", data, tmp_path / "run", "eval.blind=[mismatched]"),
        LookingJudge(rows, "vl_rewardbench", looks=False),
    )
    pooled = report.paired["real vs mismatched"][-1]
    assert pooled["b"] == pooled["c"] == 0 and pooled["p_value"] == 1.0


def test_outputs_file_errors(tmp_path):
    data = write_vlrb(tmp_path / "data")

    def score(lines):
        path = tmp_path / "outs.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" if isinstance(x, dict) else x + "\n" for x in lines))
        return evaluate(
            load(overrides=["eval.bench=vl_rewardbench", f"eval.data={data}", f"eval.outputs={path}"]), None
        )

    with pytest.raises(PreferenceDataError, match="row 99"):
        score([{"row": 99, "output": "x", "swapped": False}])
    with pytest.raises(PreferenceDataError, match="'swapped' is required"):
        score([{"row": 0, "output": "x"}])
    with pytest.raises(PreferenceDataError, match="line 1: not JSON"):
        score(["{"])
    with pytest.raises(PreferenceDataError, match="'output'"):
        score([{"row": 0, "output": None, "swapped": True}])
    report = score([{"row": 0, "output": "Overall Judgment: Answer 1 is better", "swapped": False}])
    assert report.tables["official_k1"][OVERALL].n == 1
    assert any("7 of 8 rows have no output" in n for n in report.notes)


def test_judge_vs_judge_from_outputs_files(tmp_path):
    data = write_mmrb(tmp_path / "data")
    rows = scan_rows(mm_rewardbench, data).rows
    files = []
    for name, right in (("always", lambda r: True), ("never", lambda r: r.index == 0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(
                json.dumps({"row": r.index, "output": f"[[{'AB'[r.better if right(r) else 1 - r.better]}]]"}) + "\n"
                for r in rows
            )
        )
        files.append(path)
    cfg = load(
        overrides=[
            "eval.bench=mm_rewardbench",
            f"eval.data={data}",
            f"eval.outputs={files[0]}",
            f"eval.compare=[{files[1]}]",
            f"eval.output_dir={tmp_path / 'cmp'}",
            "eval.plots=false",
        ]
    )
    paths = run_eval(cfg)
    body = json.loads(paths["json"].read_text())
    assert body["values"][0]["official/overall"] == 1.0 and body["values"][1]["official/overall"] == 1 / len(rows)
    pooled = body["paired"][0]["tests"][-1]
    assert (pooled["b"], pooled["c"], pooled["n"]) == (len(rows) - 1, 0, len(rows))
    assert pooled["p_value"] == pytest.approx(mcnemar_exact(len(rows) - 1, 0))
    assert "McNemar" in paths["markdown"].read_text()


def test_paper_prompt_reads_the_two_scores(tmp_path):
    data = write_vlrb(tmp_path / "data")
    rows = scan_rows(vl_rewardbench, data).rows

    def scores(prompts, seed):
        return [
            f"<think>x</think><answer>{9 if p.target == 'A' else 2}</answer><answer>{2 if p.target == 'A' else 9}</answer>"
            for p in prompts
        ]

    report = evaluate(cfg_for("vl_rewardbench", data, tmp_path / "r", "eval.prompt_format=paper"), scores)
    assert report.tables["official_k1"][OVERALL].value == 1.0 and report.tables["strict"][OVERALL].value == 1.0
    assert len(rows) == report.outputs


# --------------------------------------------------------------------------- pure parts and config


def test_mcnemar_exact_and_paired_test():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    t = paired_test([True, True, False, False, True], [True, False, True, False, False])
    assert (t.n, t.b, t.c) == (5, 2, 1) and t.accuracy_first == 0.6 and t.difference == pytest.approx(0.2)


def test_mismatched_images_are_a_derangement():
    images = [bytes([i]) * 4 for i in range(6)] + [bytes([0]) * 4, None]
    shown = mismatched_images(images, seed=3)
    assert shown[-1] is None
    assert all(s != img for s, img in zip(shown[:-1], images[:-1]))
    assert shown == mismatched_images(images, seed=3)
    with pytest.raises(ValueError, match="fewer than two distinct"):
        mismatched_images([b"a", b"a", None])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["eval.bench=vl_rewardbench"], "eval.data"),
        (["eval.bench=pair", "eval.data=x.jsonl", "eval.outputs=o.jsonl"], "eval.outputs"),
        (["eval.bench=vl_rewardbench", "eval.data=x", "eval.outputs=o.jsonl", "eval.judge=j"], "eval.outputs"),
        (["eval.bench=vl_rewardbench", "eval.data=x", "eval.outputs=o.txt"], "eval.outputs"),
        (
            ["eval.bench=vl_rewardbench", "eval.data=x", "eval.outputs=o.jsonl", "eval.blind=[mismatched]"],
            "eval.outputs",
        ),
        (["eval.bench=perceptual_bias", "eval.blind=[mismatched]"], "eval.blind"),
        (["eval.bench=vl_rewardbench", "eval.data=x", "eval.both_orders=true"], "eval.both_orders"),
        (["eval.bench=vl_rewardbench", "eval.data=x", "eval.compare=[a]"], "eval.compare"),
        (["trainer.keep_best=eval/vl_rewardbench/gap"], "trainer.keep_best"),
        (["trainer.keep_best_mode=best"], "trainer.keep_best_mode"),
        (["eval.train_bench=vl_rewardbench", "eval.every_steps=2"], "eval.data"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load(overrides=overrides)


@pytest.mark.parametrize("bench, writer", [("vl_rewardbench", write_vlrb), ("mm_rewardbench", write_mmrb)])
def test_training_validation_logs_accuracy_and_gap(tmp_path, bench, writer):
    from pjray.eval.reward_bench import TrainingValidation, bench_of

    data = writer(tmp_path / "data")
    cfg = load(
        overrides=[
            f"eval.train_bench={bench}",
            f"eval.data={data}",
            "eval.every_steps=2",
            "eval.train_num_items=5",
            "eval.blind=[mismatched]",
        ]
    )
    hook = TrainingValidation(cfg)
    assert len(hook.rows) == 5 and hook.rows == TrainingValidation(cfg).rows  # the same rows every time
    all_rows = scan_rows(bench_of(bench), data).rows
    metrics = hook(cfg, LookingJudge(all_rows, bench), step=2)
    assert metrics[f"eval/{bench}/accuracy"] == 1.0
    assert metrics[f"eval/{bench}/accuracy_mismatched"] == 0.0
    assert metrics[f"eval/{bench}/gap"] == 1.0 and metrics[f"eval/{bench}/unparsed"] == 0.0


def test_keep_best_records_and_resumes(tmp_path):
    from pjray.rl.best import BestJudge, improves

    assert improves(0.5, None, "max") and improves(0.6, 0.5, "max") and not improves(0.5, 0.5, "max")
    assert improves(0.4, 0.5, "min") and not improves(float("nan"), None, "max")
    best = BestJudge(tmp_path, "eval/x/gap", "max")
    assert best.improves({"eval/x/gap": 0.1})
    best.record(4, {"eval/x/gap": 0.1}, tmp_path / "hf_model_best")
    again = BestJudge(tmp_path, "eval/x/gap", "max")
    assert again.best["step"] == 4 and not again.improves({"eval/x/gap": 0.05}) and again.improves({"eval/x/gap": 0.2})
    with pytest.raises(ConfigError, match="logged no such metric"):
        again.improves({"eval/y": 1.0})
