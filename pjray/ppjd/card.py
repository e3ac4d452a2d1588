"""The PPJD job's output as a Hugging Face dataset: its card (`README.md` in `ppjd.output_dir`)
and publishing it to the hub (`ppjd.push_to_hub`).

The card's YAML header is what the hub and `datasets` read: the license, the size category, the
`default` config (split `train` = `ppjd/*.parquet`, so `load_dataset(output_dir)` reads the PPJD
rows and not the rejects) and `dataset_info` (features, split sizes), written with `datasets`'
own card helpers. Its text says how the rows were built (source, backends, filters), the
counts per stage and how well the text alone ranks the tuples, all from the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
from datasets.info import DatasetInfosDict
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCard, DatasetCardData

from pjray.data.sources import PPJD_FEATURES

DATA_FILES = "ppjd/*.parquet"
# The hub's size categories (DatasetCardData.size_categories), by upper bound.
SIZE_CATEGORIES = (
    (1_000, "n<1K"),
    (10_000, "1K<n<10K"),
    (100_000, "10K<n<100K"),
    (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"),
    (100_000_000, "10M<n<100M"),
    (1_000_000_000, "100M<n<1B"),
)


def size_category(rows: int) -> str:
    return next((name for bound, name in SIZE_CATEGORIES if rows < bound), "n>1B")


def card_data(manifest: dict[str, Any], files: list[Path]) -> DatasetCardData:
    """The YAML header: license, size, the default config's data files, features and split sizes."""
    cfg, kept = manifest["config"], manifest["counts"]["kept"]
    data = DatasetCardData(
        license=cfg["license"],
        pretty_name="PPJD: Perceptually Perturbed Judgment Dataset",
        task_categories=["image-text-to-text"],
        tags=["llm-as-a-judge", "reward-modeling", "multimodal", "pjray"],
        size_categories=size_category(kept),
    )
    metadata = [pq.read_metadata(f) for f in files]
    num_bytes = sum(m.row_group(i).total_byte_size for m in metadata for i in range(m.num_row_groups))
    download_size = sum(f.stat().st_size for f in files)
    splits = datasets.SplitDict()
    splits.add(datasets.SplitInfo(name="train", num_bytes=num_bytes, num_examples=kept))
    info = datasets.DatasetInfo(
        features=PPJD_FEATURES, splits=splits, download_size=download_size, dataset_size=num_bytes
    )
    DatasetInfosDict({"default": info}).to_dataset_card_data(data)
    MetadataConfigs({"default": {"data_files": [{"split": "train", "path": DATA_FILES}]}}).to_dataset_card_data(data)
    return data


def _source(cfg: dict[str, Any]) -> str:
    if cfg["source"] == "scenes":
        low, high = cfg["scene_objects"]
        return (
            f"{cfg['num_items']} synthetic scenes ({cfg['image_size']} px, {low}-{high} objects; question kinds "
            f"{', '.join(cfg['scene_kinds'])}), whose ground-truth facts make every perception error checkable"
        )
    return f"{cfg['source']} rows from {', '.join(Path(p).name for p in cfg['paths'])}"


def _backends(cfg: dict[str, Any]) -> list[str]:
    if cfg["perturb_backend"] == "rules":
        perturb = (
            "`rules`: model-free rewriters (scene answers recomposed from the scene's facts, free-text "
            "answers through a word lexicon)"
        )
    else:
        perturb = f"`llm`: the released verify, extract and rewrite prompts on `{cfg['llm_model']}`"
    if cfg["vqa_backend"] == "oracle":
        vqa = "`oracle`: probes answered from the scene's facts"
    else:
        vqa = f"`vlm`: probes answered from the image by `{cfg['vlm_model']}`"
    return [
        f"Perturbations: {perturb}.",
        f"Probe check: {vqa}; a tuple is kept only when every error level has "
        "probes and each probe's answer states the original fact, not the perturbed one.",
    ]


def _filters(cfg: dict[str, Any]) -> list[str]:
    decontam = (
        f"decontaminated against {len(cfg['decontam_files'])} evaluation file(s) "
        f"({', '.join(Path(p).name for p in cfg['decontam_files'])}): an image within "
        f"{cfg['phash_max_distance']} bits (dHash and pHash) of an evaluation image, or an evaluation question, is dropped"
        if cfg["decontam_files"]
        else "no decontamination files were given"
    )
    return [
        f"Chosen answers: no think tags, at most {cfg['max_chosen_chars']} characters, correct against the "
        "ground truth (or, without one, as the LLM judged).",
        "Final answers: every error level has a readable final answer that differs from the ground truth.",
        f"Evaluation overlap: {decontam}.",
    ]


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def text_only_line(audit: dict[str, Any]) -> str:
    """The text-only audit (`pjray.ppjd.shortcuts.audit`) in one line: the combined ranker against chance."""
    return (
        f"correct-first {_rate(audit['correct_first'])} (chance {_rate(audit['chance_correct_first'])}), "
        f"exact {_rate(audit['exact'])} (chance {_rate(audit['chance_exact'])}) over {audit['items']} tuples"
    )


# The card's names of the audited rankers (`pjray.ppjd.shortcuts.RANKERS`).
_RANKER_NAMES = {"combined": "both rules", "consistency": "self-consistency", "odd_one_out": "odd one out"}


def _text_only(audit: dict[str, Any]) -> list[str]:
    """The section on the text-only ranker: its scores next to chance, and what they mean."""
    by_rule = audit["by_rule"]
    return [
        "## Can the text alone rank these tuples?",
        "",
        "Two rules that never look at the image rank each tuple: an answer whose reasoning contradicts itself goes "
        "last (self-consistency), and an answer whose stated facts differ from those all the others share goes "
        "first (odd one out); ties count as broken at random.",
        "",
        "| ranker | correct first | exact ranking |",
        "|---|---|---|",
        *(
            f"| {name} | {_rate(by_rule[rule]['correct_first'])} | {_rate(by_rule[rule]['exact'])} |"
            for rule, name in _RANKER_NAMES.items()
        ),
        f"| chance | {_rate(audit['chance_correct_first'])} | {_rate(audit['chance_exact'])} |",
        "",
        "The further these rankers are above chance, the more of the order a judge can learn from the text "
        "without looking at the image.",
    ]


def card_text(manifest: dict[str, Any]) -> str:
    """The card's body: what the rows are, how they were built, the counts, whether the text alone
    ranks them, how to load them."""
    cfg, counts = manifest["config"], manifest["counts"]
    k = cfg["num_candidates"]
    lines = [
        "# PPJD: Perceptually Perturbed Judgment Dataset",
        "",
        f"Ranked candidate tuples for training multimodal judges: for one image and question, K = {k} answers "
        "ordered from best to worst: the correct answer, then answers with perception errors (fluent reasoning "
        "about the wrong visual facts), then perception and reasoning errors. Built with `pjray ppjd` "
        f"(config hash `{manifest['config_hash']}`).",
        "",
        "## How it was built",
        "",
        f"- Source: {_source(cfg)}.",
        *(f"- {line}" for line in _backends(cfg) + _filters(cfg)),
        f"- Seed {cfg['seed']}; candidates are shuffled per tuple by a seed of its id.",
        "",
        "## Counts",
        "",
        f"{counts['read']} rows read, {counts['kept']} kept, {counts['rejected']} rejected. Rejected rows, with "
        "their stage and reason, are in `rejects/` of the job's output and not part of the dataset.",
        "",
        "| stage | in | rejected | out |",
        "|---|---|---|---|",
        *(f"| {stage} | {e['in']} | {e['rejected']} | {e['out']} |" for stage, e in manifest["stages"].items()),
        "",
        *_text_only(manifest["text_only_ranker"]),
        "",
        "## Fields",
        "",
        "- `id`: the source row's id; `source`: where the row came from.",
        "- `image`: the image (an `Image` feature); `question`: the question about it.",
        f"- `candidates`: the {k} answers; `order`: candidate indices from best to worst.",
        "- `meta`: JSON: the ground truth, the perception attributes, each level's errors and its probes.",
        "",
        "## Loading",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("parquet", data_dir="ppjd", split="train")  # in the output folder; or the hub id',
        "```",
        "",
        "Train a judge on it: `pjray train data.source=hf data.path=<this folder or hub id>`.",
        "",
    ]
    return "\n".join(lines)


def dataset_card(out: Path, manifest: dict[str, Any]) -> DatasetCard:
    files = sorted((out / "ppjd").glob("shard-*.parquet"))
    return DatasetCard(f"---\n{card_data(manifest, files).to_yaml()}\n---\n\n{card_text(manifest)}")


def push_to_hub(out: Path, repo_id: str) -> None:
    """Publish the PPJD rows and the card as the hub dataset `repo_id`.

    The card goes up first, without its local sizes, so that `Dataset.push_to_hub` keeps its text
    and license and writes the data files and sizes of what it uploads (`ppjd/train-*`)."""
    from huggingface_hub import HfApi

    card = DatasetCard.load(out / "README.md")
    card.data.pop("dataset_info")  # the sizes of the uploaded files are Dataset.push_to_hub's to write
    HfApi().create_repo(repo_id, repo_type="dataset", exist_ok=True)
    card.push_to_hub(repo_id, commit_message="PPJD dataset card")
    rows = datasets.load_dataset("parquet", data_dir=str(out / "ppjd"), split="train")
    rows.push_to_hub(repo_id, split="train", data_dir="ppjd", commit_message="PPJD rows")
