"""Tiny VL-RewardBench and Multimodal RewardBench files in their published layouts, written by
the tests: a few rows per group and category, each with a small image of its own colour."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

# VL-RewardBench ids: two of each group's sources, one id repeated (the published data repeats ids).
VLRB_IDS = (
    "vlfeedback_1",
    "wildvision-battle_2",
    "hallucination_pair_3",
    "RLAIF-V_4",
    "RLHF-V-5",
    "mathverse_6",
    "mmmu-7",
    "RLAIF-V_4",
)
# Multimodal RewardBench (ID, Category): every reporting category, safety and reasoning split by ID.
MMRB_ROWS = (
    ("nocaps_1", "open_generation/correctness_task"),
    ("vlfeedback_2", "open_generation/preference_task"),
    ("mmmu_3", "knowledge"),
    ("mathverse_4", "reasoning"),
    ("coding_5", "reasoning"),
    ("PAIRS_6", "safety"),
    ("hateful_7", "safety"),
    ("vqa_8", "vqa"),
)


def png(index: int, size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), ((37 * index) % 256, (91 * index + 40) % 256, (53 * index + 90) % 256)).save(
        buf, "PNG"
    )
    return buf.getvalue()


def vlrb_rows() -> list[dict]:
    """Rows of the hub parquet's fields; response[0] is preferred except in every third row."""
    rows = []
    for i, row_id in enumerate(VLRB_IDS):
        better_first = i % 3 != 2
        rows.append(
            {
                "id": row_id,
                "query": f"What is shown in picture {i}?",
                "response": [f"good answer {i}", f"bad answer {i}"]
                if better_first
                else [f"bad answer {i}", f"good answer {i}"],
                "image": {"bytes": png(i), "path": f"{i}.png"},
                "human_ranking": [0, 1] if better_first else [1, 0],
                "models": ["m1", "m2"],
                "judge": "gpt-4o",
                "rationale": "",
                "query_source": row_id.split("_")[0],
                "ground_truth": "",
            }
        )
    return rows


def write_vlrb(folder: Path, layout: str = "parquet") -> Path:
    """`parquet`: the hub's test split file (images as {bytes, path}); `jsonl`: the repository's
    data.jsonl with `image_path` files under images/."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = vlrb_rows()
    if layout == "parquet":
        path = folder / "test-00000-of-00001.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    path = folder / "data.jsonl"
    (folder / "images").mkdir(exist_ok=True)
    with path.open("w") as f:
        for i, row in enumerate(rows):
            image = row.pop("image")
            (folder / "images" / f"{i}.png").write_bytes(image["bytes"])
            f.write(json.dumps({**row, "image_path": f"images/{i}.png"}) + "\n")
    return path


def mmrb_rows() -> list[dict]:
    """Rows of all_data_release.json; Output1 is better in odd rows."""
    return [
        {
            "ID": row_id,
            "Text": f"Describe picture {i}.",
            "Image": f"images/{i}.png",
            "Output1": f"answer one {i}",
            "Output2": f"answer two {i}",
            "Better": "Output1" if i % 2 else "Output2",
            "Category": category,
        }
        for i, (row_id, category) in enumerate(MMRB_ROWS)
    ]


def write_mmrb(folder: Path, layout: str = "json") -> Path:
    """`json`: the release's JSON list with images under images/ (paths relative to its folder);
    `jsonl`: the same rows a line each; `parquet`: images as bytes in the rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = mmrb_rows()
    if layout == "parquet":
        for i, row in enumerate(rows):
            row["Image"] = {"bytes": png(100 + i), "path": row["Image"]}
        path = folder / "mmrb.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    (folder / "images").mkdir(exist_ok=True)
    for i in range(len(rows)):
        (folder / "images" / f"{i}.png").write_bytes(png(100 + i))
    if layout == "json":
        path = folder / "all_data_release.json"
        path.write_text(json.dumps(rows))
    else:
        path = folder / "all_data_release.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
