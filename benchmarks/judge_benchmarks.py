"""The shipped base judge and the default trained judge on VL-RewardBench and Multimodal
RewardBench fixtures built from the scene world, real image against a mismatched one.

    python benchmarks/judge_benchmarks.py                       # 96 rows a bench; trains the default run if needed
    python benchmarks/judge_benchmarks.py --trained runs/demo/hf_model --rows 48

No model hub is reached here, so the two benchmarks' real rows cannot be judged; instead each
schema is filled with held-out scene tuples (one object, colour or size, the content split no
training image holds), written in the published layouts (VL-RewardBench's hub parquet,
Multimodal RewardBench's JSON list with image files) and read back by `pjray eval` like the real
files. Each tuple gives one preference pair, cycling over three kinds, which name the
benchmark's groups:

| pair (preferred vs rejected) | VL-RewardBench id (group) | Multimodal RewardBench category |
|---|---|---|
| correct vs perception error (fluent, one wrong fact) | `hallucination_*` (hallucination) | `open_generation/correctness_task` |
| correct vs perception + reasoning error | `mathverse_*` (reasoning) | `reasoning` with a `math` ID (reasoning/math) |
| perception error vs perception + reasoning error | `vlfeedback_*` (general) | `vqa` |

The preferred response is first in half the rows (VL-RewardBench's order is drawn per sample
anyway; Multimodal RewardBench shows Output1 as A, so its label is balanced instead). Both judges
answer each benchmark's official prompt and pjray's paper pair prompt (`eval.prompt_format`:
`original`, `paper`: the Perception-Judge pair prompt, two scores), greedily, one sample; each
bench is judged with the real images and again with every row shown another row's image
(`eval.blind=[mismatched]`), and the two judges are compared on the same rows (`eval.compare`).
Every number is one greedy run of each judge on one fixture set: the intervals are the paired
tests' only.

Writes judge_benchmarks.{md,json} into benchmarks/results (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pjray.config import load
from pjray.ppjd.perturb import scene_items
from pjray.recipes.base_judge import SHIPPED

ROOT = Path(__file__).resolve().parents[1]
SCENE_SEED = 20261206  # the fixtures' scenes (held-out content split)
PAIRS = (  # (name, preferred level, rejected level): levels of the tuple's order, best -> worst
    ("hallucination", 0, 1),
    ("reasoning", 0, 2),
    ("general", 1, 2),
)
VLRB_PREFIX = {"hallucination": "hallucination", "reasoning": "mathverse", "general": "vlfeedback"}
MMRB_CATEGORY = {
    "hallucination": ("correct", "open_generation/correctness_task"),
    "reasoning": ("math", "reasoning"),
    "general": ("vqa", "vqa"),
}


def pairs(n: int, image_size: int) -> list[dict]:
    """`n` preference pairs from held-out scene tuples, the three kinds in turn."""
    items = scene_items(
        n,
        seed=SCENE_SEED,
        num_candidates=3,
        image_size=image_size,
        kinds=("color", "size"),
        objects=(1, 1),
        split="held_out",
        construction="independent",
    )
    out = []
    for i, item in enumerate(items):
        name, good, bad = PAIRS[i % len(PAIRS)]
        out.append(
            {
                "index": i,
                "kind": name,
                "question": item.question,
                "image": item.image,
                "preferred": item.candidates[item.order[good]],
                "rejected": item.candidates[item.order[bad]],
                "preferred_first": (i // len(PAIRS)) % 2 == 0,
            }
        )
    return out


def write_vlrb(rows: list[dict], folder: Path) -> Path:
    """The hub parquet's layout: id, query, response [2], image {bytes, path}, human_ranking, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    table = []
    for r in rows:
        responses = [r["preferred"], r["rejected"]] if r["preferred_first"] else [r["rejected"], r["preferred"]]
        table.append(
            {
                "id": f"{VLRB_PREFIX[r['kind']]}_scene_{r['index']}",
                "query": r["question"],
                "response": responses,
                "image": {"bytes": r["image"], "path": f"{r['index']}.png"},
                "human_ranking": [0, 1] if r["preferred_first"] else [1, 0],
                "models": ["scene", "scene"],
                "judge": "scene world",
                "rationale": "",
                "query_source": "scenes",
                "ground_truth": r["preferred"],
            }
        )
    path = folder / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def write_mmrb(rows: list[dict], folder: Path) -> Path:
    """all_data_release.json with its images beside it (paths relative to its folder)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    listed = []
    for r in rows:
        prefix, category = MMRB_CATEGORY[r["kind"]]
        (folder / "images" / f"{r['index']}.png").write_bytes(r["image"])
        first, second = (r["preferred"], r["rejected"]) if r["preferred_first"] else (r["rejected"], r["preferred"])
        listed.append(
            {
                "ID": f"{prefix}_scene_{r['index']}",
                "Text": r["question"],
                "Image": f"images/{r['index']}.png",
                "Output1": first,
                "Output2": second,
                "Better": "Output1" if r["preferred_first"] else "Output2",
                "Category": category,
            }
        )
    path = folder / "all_data_release.json"
    path.write_text(json.dumps(listed, indent=1))
    return path


def trained_judge(path: str, work: Path) -> Path:
    """The default run's judge: `path`, or trained here with `pjray train`'s defaults."""
    if path:
        return Path(path)
    run_dir = work / "demo"
    if not (run_dir / "hf_model" / "config.json").is_file():
        print(f"training the default run into {run_dir} (3-7 min on 2 cores)", flush=True)
        subprocess.run([sys.executable, "-m", "pjray", "train", f"trainer.run_dir={run_dir}"], check=True, cwd=ROOT)
    return run_dir / "hf_model"


def evaluate(bench: str, prompt_format: str, data: Path, base: Path, trained: Path, out: Path) -> dict:
    """Both judges on one bench through `pjray eval` (real and mismatched, compared)."""
    from pjray.eval.runner import run_eval

    cfg = load(
        overrides=[
            f"eval.bench={bench}",
            f"eval.data={data}",
            f"eval.judge={base}",
            f"eval.compare=[{trained}]",
            f"eval.prompt_format={prompt_format}",
            "eval.blind=[mismatched]",
            "eval.max_new_tokens=64",
            "eval.temperature=0",
            f"eval.output_dir={out}",
            "eval.plots=false",
            "eval.cache=false",
        ]
    )
    started = time.perf_counter()
    run_eval(cfg)
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    reports = [json.loads((f / "report.json").read_text()) for f in folders]
    outputs = [
        [json.loads(line)["output"] for line in (f / "outputs.jsonl").read_text().splitlines()[:2]] for f in folders
    ]
    return {
        "seconds": time.perf_counter() - started,
        "reports": reports,
        "examples": outputs,
        "compare": json.loads((out / "compare.json").read_text()),
    }


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def markdown(results: dict, rows: int) -> str:
    lines = [
        "# Judges on VL-RewardBench and Multimodal RewardBench fixtures from the scene world",
        "",
        "Written by `python benchmarks/judge_benchmarks.py` (see its docstring for how the fixtures are built). "
        f"{rows} rows a bench, greedy, one sample; **one run of each judge on one fixture set**.",
        "",
    ]
    for key, got in results["runs"].items():
        bench, fmt = key.split("/")
        official = "official_k1" if bench == "vl_rewardbench" else "official"
        lines += [
            f"## {bench}, prompt {fmt}",
            "",
            f"`pjray eval` took {got['seconds']:.0f} s for both judges, both images.",
            "",
        ]
        lines += [
            "| judge | group | official, real | official, mismatched | strict, real | strict, mismatched | "
            "unreadable (real) | paired test real vs mismatched: b / c, p |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, report in zip(results["judges"], got["reports"]):
            blind = report["blind"]["mismatched"]["tables"]
            tests = {t["group"]: t for t in report["paired"]["real vs mismatched"]}
            unreadable = {g: c["unparsed"] for g, c in report["tables"]["strict"].items()}
            for group, cell in report["tables"]["strict"].items():
                if group == "macro":
                    continue
                t = tests[group]
                lines.append(
                    f"| {name} | {group} | {_pct(report['tables'][official].get(group, {}).get('value'))} | "
                    f"{_pct(blind[official].get(group, {}).get('value'))} | {_pct(cell['value'])} | "
                    f"{_pct(blind['strict'][group]['value'])} | {unreadable[group]} of {cell['n']} | "
                    f"{t['b']} / {t['c']}, p = {t['p_value']:.2g} |"
                )
        pooled = got["compare"]["paired"][0]["tests"][-1]
        lines += [
            "",
            f"Judge vs judge on the same rows (strict per-item verdicts, real images): base {_pct(pooled['accuracy_first'])}, "
            f"trained {_pct(pooled['accuracy_second'])}; b = {pooled['b']} (base only), c = {pooled['c']} (trained only), "
            f"exact McNemar p = {pooled['p_value']:.2g}.",
            "",
            "What they write (the first row's output):",
            "",
        ]
        lines += [f"- {name}: `{examples[0][:160]!r}`" for name, examples in zip(results["judges"], got["examples"])]
        lines.append("")
    lines += ["## Reading it", "", *reading(results), ""]
    return "\n".join(lines)


def reading(results: dict) -> list[str]:
    """What the tables say, from their numbers."""
    unread = {name: [0, 0] for name in results["judges"]}
    for got in results["runs"].values():
        for name, report in zip(results["judges"], got["reports"]):
            overall = report["tables"]["strict"]["overall"]
            unread[name][0] += overall["unparsed"]
            unread[name][1] += overall["n"]
    counts = ", ".join(f"{name} {u} of {n}" for name, (u, n) in unread.items())
    out = [f"- Verdicts no pairwise reading accepts (strict, real images, all four runs): {counts}."]
    if all(u == n for u, n in unread.values()):
        out += [
            "- Neither judge writes a pairwise verdict. The shipped base judge was supervised on K = 3 batch rankings, "
            "single-answer scores and VQA, never on pairs (`pjray/models/base_judge.py`), and the default run trains "
            "the K = 3 ranking: shown two answers, both still "
            'write three letters ("A > B > C") or a bare value, under the official prompts and the paper pair prompt '
            "alike. So these fixtures say nothing about whether either judge looks: with no verdict there is nothing "
            "for the mismatched image to change (b = c = 0, p = 1), and the two judges cannot be told apart.",
            "- Multimodal RewardBench's official reading tosses a coin (seeded 123, in file order) for every unreadable "
            "verdict, so a judge that never answers scores about 50% there, the same with the mismatched image; the "
            "strict column beside it shows that nothing was answered. VL-RewardBench's official scoring leaves "
            "unreadable items out of its denominators, so with none decided its accuracies are undefined (n/a).",
            "- What the two benchmarks need is a judge that answers pairwise prompts: the real-model recipes "
            "(`configs/qwen3vl_4b.yaml`, `configs/flex_judge_7b.yaml`), not run here (no model hub). The scoring itself "
            "is checked against re-derivations of both official scripts on scripted judges "
            "(`tests/unit/test_reward_benches.py`).",
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=96, help="rows a bench (a multiple of 6 keeps kinds and order balanced)"
    )
    parser.add_argument("--trained", default="", help="the trained judge (HF dir); empty: train the default run")
    parser.add_argument(
        "--work", default="runs/judge_benchmarks", help="fixtures, the trained run and the eval outputs"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown from the saved JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        results = json.loads((out / "judge_benchmarks.json").read_text())
        (out / "judge_benchmarks.md").write_text(markdown(results, results["rows"]))
        return 0
    work = Path(args.work).resolve()
    image_size = load().data.image_size
    rows = pairs(args.rows, image_size)
    data = {
        "vl_rewardbench": write_vlrb(rows, work / "vl_rewardbench"),
        "mm_rewardbench": write_mmrb(rows, work / "mm_rewardbench"),
    }
    base, trained = SHIPPED / "hf_model", trained_judge(args.trained, work)
    results: dict = {
        "rows": args.rows,
        "scene_seed": SCENE_SEED,
        "judges": ["base", "trained"],
        "judge_paths": [str(base), str(trained)],
        "runs": {},
    }
    for bench, path in data.items():
        for fmt in ("original", "paper"):
            results["runs"][f"{bench}/{fmt}"] = evaluate(bench, fmt, path, base, trained, work / f"eval_{bench}_{fmt}")
    out.mkdir(parents=True, exist_ok=True)
    # Paths relative to the repository, so the committed file names no machine's folders.
    (out / "judge_benchmarks.json").write_text(json.dumps(results, indent=1, default=str).replace(f"{ROOT}/", ""))
    (out / "judge_benchmarks.md").write_text(markdown(results, args.rows))
    print(markdown(results, args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
