"""Training and evaluation rows from Hugging Face `datasets` (pjray.data.hf): finding a dataset,
its split and subset, mapping columns onto PPJD, checking rows, and streaming with an exact
resume. Local folders only, with the hub offline."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import datasets
import huggingface_hub
import pytest
from PIL import Image

from pjray.config import ConfigError, PathError, load
from pjray.data.hf import (
    DatasetItems,
    DatasetRef,
    StreamSampler,
    StreamState,
    eval_source,
    map_columns,
    open_dataset,
    scan_judge_items,
)
from pjray.data.sources import DataError, write_items
from pjray.eval.judge_bench import scan_rows
from pjray.eval.mm_judgebias import scan_records
from pjray.ppjd.perturb import scene_items

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(autouse=True)
def offline_with_own_cache(tmp_path, monkeypatch):
    """No hub, and `datasets`' cache in the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def items():
    return scene_items(6, seed=2, num_candidates=3, image_size=64)


def png(color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def pair_folder(path: Path, items, bad: dict[int, dict] | None = None) -> Path:
    """A preference-pair dataset as JSONL with image files: prompt / picture / chosen / rejected."""
    (path / "img").mkdir(parents=True)
    lines = []
    for i, it in enumerate(items):
        (path / "img" / f"{i}.png").write_bytes(it.image)
        row = {
            "uid": it.id,
            "prompt": it.question,
            "picture": f"img/{i}.png",
            "chosen": it.candidates[it.order[0]],
            "rejected": it.candidates[it.order[-1]],
        }
        row.update((bad or {}).get(i, {}))
        lines.append(json.dumps(row))
    (path / "train.jsonl").write_text("\n".join(lines) + "\n")
    return path


PAIR_COLUMNS = {"id": "uid", "question": "prompt", "image": "picture"}


# ----------------------------------------------------------------------------- columns


def test_columns_map_by_name_or_by_data_columns():
    ppjd = ["id", "image", "question", "candidates", "order", "source", "meta"]
    m = map_columns(ppjd, {}, "d")
    assert m.fields == {c: c for c in ppjd} and not m.pairs
    m = map_columns(
        ["q", "img", "answers", "rank"],
        {"question": "q", "image": "img", "candidates": "answers", "order": "rank"},
        "d",
    )
    assert m.fields == {"question": "q", "image": "img", "candidates": "answers", "order": "rank"}
    m = map_columns(["prompt", "images", "chosen", "rejected"], {"question": "prompt", "image": "images"}, "d")
    assert m.pairs and m.fields == {"question": "prompt", "image": "images", "chosen": "chosen", "rejected": "rejected"}


def test_a_missing_column_names_what_exists_and_the_key_to_set():
    with pytest.raises(
        DataError,
        match=r"^org/x \[train\]: no column for question \(columns: prompt, image, "
        r"chosen, rejected\); name yours with data.columns.question=COLUMN",
    ):
        map_columns(["prompt", "image", "chosen", "rejected"], {}, "org/x [train]")
    with pytest.raises(
        DataError, match=r"no column for candidates, order .*=COLUMN \(a pair dataset: chosen and rejected\)$"
    ):
        map_columns(["question", "image", "answers"], {}, "d")
    with pytest.raises(DataError, match=r"^d: data.columns.question=prompt: no such column \(columns: q, image\)"):
        map_columns(["q", "image"], {"question": "prompt"}, "d")


def test_data_columns_keys_are_validated():
    base = ["data.source=hf", "data.path=org/x"]
    assert load(overrides=[*base, "data.columns.question=prompt"]).data.columns == {"question": "prompt"}
    with pytest.raises(ConfigError, match="data.columns.verdict: not a field; expected one of id, image"):
        load(overrides=[*base, "data.columns.verdict=x"])
    with pytest.raises(ConfigError, match="data.columns.answer: a policy's reference answer"):
        load(overrides=[*base, "data.columns.answer=x"])
    with pytest.raises(ConfigError, match="data.streaming: only read when data.source=hf"):
        load(overrides=["data.streaming=true"])
    with pytest.raises(ConfigError, match="data.columns: only read when data.source=hf"):
        load(overrides=["data.source=parquet", "data.path=x", "data.columns.question=q"])


# ----------------------------------------------------------------------------- rows


def test_a_pair_dataset_with_renamed_columns_becomes_k2_tuples(tmp_path, items):
    folder = pair_folder(tmp_path / "pairs", items, bad={3: {"picture": "img/gone.png"}, 4: {"rejected": None}})
    data = open_dataset(DatasetRef(str(folder), "train"))
    scanned = DatasetItems(data, PAIR_COLUMNS, 2, "pairs").scan()
    assert [it.id for it in scanned.rows] == [items[i].id for i in (0, 1, 2, 5)]
    first = scanned.rows[0]
    assert first.image == items[0].image and first.question == items[0].question
    assert first.candidates == (items[0].candidates[items[0].order[0]], items[0].candidates[items[0].order[-1]])
    assert first.order == (0, 1) and first.source == "pairs"
    label = f"{folder} [train]"
    assert [(r.where, r.row_id, r.reason) for r in scanned.rejects] == [
        (f"{label} row 3", items[3].id, f"image 'img/gone.png' not found under {folder}"),
        (f"{label} row 4", items[4].id, "missing field(s) rejected"),
    ]
    with pytest.raises(
        DataError, match=r"pairs are K = 2 tuples, but data.num_candidates=3; set data.num_candidates=2"
    ):
        DatasetItems(data, PAIR_COLUMNS, 3, "pairs")


def test_images_as_image_features_bytes_paths_or_one_image_lists(tmp_path, items):
    it = items[0]
    base = {"question": it.question, "candidates": list(it.candidates), "order": list(it.order)}
    (tmp_path / "a.png").write_bytes(it.image)
    feature = datasets.Dataset.from_list([{**base, "image": {"bytes": it.image, "path": None}}]).cast_column(
        "image", datasets.Image()
    )
    raw_bytes = datasets.Dataset.from_list([{**base, "image": it.image}])
    paths = datasets.Dataset.from_list([{**base, "image": str(tmp_path / "a.png")}])
    lists = datasets.Dataset.from_list([{**base, "image": [str(tmp_path / "a.png")]}, {**base, "image": ["x", "y"]}])
    for name, ds in {"feature": feature, "bytes": raw_bytes, "paths": paths, "lists": lists}.items():
        ds.save_to_disk(tmp_path / name)
        scanned = DatasetItems(open_dataset(DatasetRef(str(tmp_path / name), "train")), {}, 3, name).scan()
        assert [x.image for x in scanned.rows] == [it.image], name
    assert scanned.rejects[0].reason == "image holds 2 images; a judge prompt shows one"


def test_ppjd_written_by_pjray_loads_with_datasets_and_back(tmp_path, items):
    write_items(items, tmp_path / "ppjd" / "shard-00000.parquet")
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "ppjd"), split="train")
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds[0]["image"].size == (64, 64)  # decoded by datasets as a PIL image
    assert scan_judge_items(open_dataset(DatasetRef(str(tmp_path / "ppjd"), "train"))).rows == items


# ----------------------------------------------------------------------------- finding the dataset


def test_a_saved_dataset_dict_picks_the_split_and_names_the_others(tmp_path, items):
    write_items(items, tmp_path / "p" / "a.parquet")
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "p"), split="train")
    datasets.DatasetDict(train=ds.select(range(4)), test=ds.select(range(4, 6))).save_to_disk(tmp_path / "dd")
    test = open_dataset(DatasetRef(str(tmp_path / "dd"), "test"))
    assert test.label == f"{tmp_path / 'dd'} [test]" and len(list(test.rows)) == 2
    with pytest.raises(PathError, match=r"^data.split: dev: no such split of .*dd \(splits: train, test\)"):
        open_dataset(DatasetRef(str(tmp_path / "dd"), "dev"))
    with pytest.raises(PathError, match=r"^eval.split: .*dd has splits train, test; name one"):
        open_dataset(DatasetRef(str(tmp_path / "dd"), "", section="eval"))
    with pytest.raises(PathError, match=r"^data.subset: x: a saved dataset .* has no subsets"):
        open_dataset(DatasetRef(str(tmp_path / "dd"), "train", subset="x"))


@pytest.mark.parametrize(
    "ref, message",
    [
        (
            DatasetRef("pjray-no-such-owner/no-such-data"),
            r"^data.path: pjray-no-such-owner/no-such-data: no such folder, "
            r"and not in the datasets cache; the hub could not be asked",
        ),
        (DatasetRef("runs/nope"), r"^data.path: runs/nope: no such file or directory \(and not a hub id owner/name\)"),
        (DatasetRef("data/a.parquet"), r"^data.path: data/a.parquet: a file; a dataset is a folder or a hub id"),
        (DatasetRef("data", "test"), r"^data.split: test: no such split of data \(splits: train\)"),
        (DatasetRef("data", "train", subset="big"), r"^data.subset: big: no such subset of data \(subsets: default\)"),
        (
            DatasetRef("data", "train", revision="v2"),
            r"^data.revision: v2: only for a hub dataset \(data is a local folder\)",
        ),
        (DatasetRef("empty", section="eval"), r"^eval.data: empty: no data files"),
    ],
)
def test_a_missing_dataset_split_or_subset_is_one_line(ref, message, tmp_path, monkeypatch, items):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "empty").mkdir()
    write_items(items, tmp_path / "data" / "a.parquet")
    with pytest.raises(PathError, match=message) as err:
        open_dataset(ref)
    assert "\n" not in str(err.value)


def test_eval_data_is_a_file_or_a_dataset(tmp_path):
    e = load(overrides=[f"eval.data={FIXTURES / 'mllm_judge' / 'pair.jsonl'}", "eval.split=train"]).eval
    with pytest.raises(ConfigError, match="eval.split: only read when eval.data is a dataset"):
        eval_source(e)
    e = load(overrides=[f"eval.data={FIXTURES / 'mllm_judge' / 'pair.jsonl'}"]).eval
    assert eval_source(e) == str(FIXTURES / "mllm_judge" / "pair.jsonl")


# ----------------------------------------------------------------------------- evaluation rows


def test_mllm_judge_rows_from_a_dataset_read_both_field_variants(tmp_path):
    """The published pair rows as a dataset (images embedded as an Image feature) give the same
    rows as the JSONL files, in both field-name variants."""
    for name in ("pair", "pair_variant"):
        source = FIXTURES / "mllm_judge" / f"{name}.jsonl"
        rows = [json.loads(line) for line in source.read_text().splitlines()]
        key = "image_path" if "image_path" in rows[0] else "image"
        for r in rows:
            r[key] = {"bytes": (FIXTURES / "mllm_judge" / r[key]).read_bytes(), "path": None}
        ds = datasets.Dataset.from_list(rows).cast_column(key, datasets.Image())
        ds.save_to_disk(tmp_path / name)
        from_dataset = scan_rows(open_dataset(DatasetRef(str(tmp_path / name), section="eval")), "pair")
        from_file = scan_rows(source, "pair")
        assert from_dataset.rows == from_file.rows and len(from_dataset.rows) >= 2
        assert not from_dataset.rejects


def test_mm_judgebias_records_from_a_dataset_folder(tmp_path):
    """A folder of JSONL records whose image paths are relative to eval.image_dir."""
    folder = tmp_path / "bias"
    folder.mkdir()
    shutil.copy(FIXTURES / "mm_judgebias" / "records.jsonl", folder)
    records = scan_records(open_dataset(DatasetRef(str(folder), section="eval")), FIXTURES / "mm_judgebias")
    assert records.rows == scan_records(FIXTURES / "mm_judgebias" / "records.jsonl").rows
    assert records.rows and records.source == f"{folder} [train]"


# ----------------------------------------------------------------------------- streaming


def stream_folder(path: Path, num: int, bad: set[int]) -> Path:
    """PPJD rows in three parquet files (three stream shards); rows in `bad` have a broken image."""
    rows = scene_items(num, seed=5, num_candidates=3, image_size=64)
    rows = [dataclasses.replace(r, image=r.image[:30]) if i in bad else r for i, r in enumerate(rows)]
    for part in range(3):
        write_items(rows[part * num // 3 : (part + 1) * num // 3], path / f"part-{part}.parquet")
    return path


def sampler(folder: Path, state: StreamState | None, rejects: Path, fraction: float = 0.5) -> StreamSampler:
    items = DatasetItems(open_dataset(DatasetRef(str(folder), "train"), streaming=True), {}, 3, "s")
    return StreamSampler(items, state, rejects, fraction)


def test_a_stream_resumes_exactly_where_its_checkpoint_stopped(tmp_path):
    folder = stream_folder(tmp_path / "s", 12, bad={4})
    rejects = tmp_path / "run" / "data_rejects.jsonl"
    whole = [(i, it.id) for i, it in sampler(folder, None, tmp_path / "other.jsonl").take(30)]
    assert [i for i, _ in whole] == list(range(30))  # 11 good rows a pass, 3 passes and a bit
    first = sampler(folder, None, rejects)
    head = [(i, it.id) for i, it in first.take(7)]
    saved = json.loads(json.dumps(dataclasses.asdict(first.state)))  # as a checkpoint stores it
    assert saved["row"] == 8 and saved["rejected"] == 1 and saved["position"]
    first.take(10)  # the run goes on past its last checkpoint, into the second pass, then dies
    resumed = sampler(folder, StreamState(**saved), rejects)
    tail = [(i, it.id) for i, it in resumed.take(23)]
    assert head + tail == whole
    assert resumed.epoch == 2 and resumed.state.rejected == 1
    # The bad row is listed once: from the first pass, not again from the later ones.
    listed = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [r["where"] for r in listed] == [f"{folder} [train] row 4"]


def test_a_stream_of_mostly_bad_rows_fails_with_the_first_of_them(tmp_path):
    folder = stream_folder(tmp_path / "s", 6, bad={0, 1, 2, 3})
    s = sampler(folder, None, tmp_path / "rejects.jsonl", fraction=0.5)
    with pytest.raises(
        DataError,
        match=r"\[train\]: 4 of the 6 rows read are bad \(more than data.max_reject_fraction="
        r"0.5\): .* row 0: could not decode image",
    ):
        s.take(10)


def test_a_streamed_row_the_trainer_cannot_use_is_listed_with_its_reason(tmp_path):
    """The trainer's check of a well-formed row (its prompt too long for rollout.max_model_len)
    rejects it as the stream reads it, once, with the reason it gave."""
    folder = stream_folder(tmp_path / "s", 6, bad=set())
    items = DatasetItems(open_dataset(DatasetRef(str(folder), "train"), streaming=True), {}, 3, "s")
    too_long = {scene_items(6, seed=5, num_candidates=3, image_size=64)[2].id}
    rejects = tmp_path / "rejects.jsonl"
    s = StreamSampler(
        items, None, rejects, 0.5, reject=lambda item: "prompt of 9000 tokens" if item.id in too_long else None
    )
    taken = [it.id for _, it in s.take(10)]
    assert not too_long & set(taken) and len(taken) == 10
    [listed] = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert listed["where"] == f"{folder} [train] row 2" and "prompt of 9000 tokens" in listed["reason"]


def test_perceptual_bias_items_from_a_dataset_equal_those_from_its_parquet(tmp_path, items):
    from pjray.eval.bias import load_diagnosis_items

    write_items(items, tmp_path / "ppjd.parquet")
    datasets.load_dataset("parquet", data_files=str(tmp_path / "ppjd.parquet"), split="train").save_to_disk(
        tmp_path / "saved"
    )
    from_file = load_diagnosis_items(load(overrides=[f"eval.data={tmp_path / 'ppjd.parquet'}"]))
    from_dataset = load_diagnosis_items(load(overrides=[f"eval.data={tmp_path / 'saved'}"]))
    assert from_dataset == from_file and len(from_file[0]) == len(items)
