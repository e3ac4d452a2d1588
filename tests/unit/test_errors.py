"""What a failed command shows: every path checked before Ray starts, one line, exit code 2 for
bad input and 1 for a bug; the traceback only with --debug."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import RayTaskError

from pjray.cli import main
from pjray.config import ConfigError, PathError, load
from pjray.data.sources import DataError
from pjray.errors import EXIT_BUG, EXIT_INPUT, explain
from pjray.inputs import check_inputs, check_model, is_hub_id

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "mllm_judge"


def fake_judge(path: Path) -> Path:
    """A directory that passes the path check (a config.json); nothing here loads it."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory) -> Path:
    """A judge to train, built before the test (its build's output is not the command's)."""
    from pjray.models.tiny import build_tiny_judge

    return build_tiny_judge(tmp_path_factory.mktemp("judge") / "tiny", seed=0)


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert not ray.is_initialized(), "a bad input must be reported before Ray starts"
    return code, err


# ----------------------------------------------------------------------------- explain


def test_input_errors_are_one_line_with_exit_code_2():
    assert explain(ConfigError("algo.group_size: must be >= 2")) == (
        EXIT_INPUT,
        "pjray: bad config: algo.group_size: must be >= 2",
    )
    assert explain(DataError("f.parquet row 3: empty image")) == (
        EXIT_INPUT,
        "pjray: bad data: f.parquet row 3: empty image",
    )
    assert explain(PathError("data.path: x: no such file")) == (EXIT_INPUT, "pjray: data.path: x: no such file")


def test_a_bug_is_exit_code_1_with_a_debug_hint():
    code, line = explain(TypeError("unsupported operand\nsecond line"))
    assert code == EXIT_BUG
    assert line.startswith("pjray: internal error: TypeError: unsupported operand (") and "--debug" in line
    assert "\n" not in line


def test_errors_from_ray_workers_are_unwrapped_to_their_cause():
    cause = DataError("shard.parquet row 7: could not decode image")
    wrapped = RayTaskError("RolloutWorker.generate", "Traceback (most recent call last):\n  ...", cause)
    # As ray.get raises it: an instance of both RayTaskError and the cause's class.
    dual = wrapped.as_instanceof_cause()
    assert isinstance(dual, DataError)
    assert explain(dual) == (EXIT_INPUT, "pjray: bad data: shard.parquet row 7: could not decode image")
    assert explain(wrapped) == explain(dual)
    bug = RayTaskError("f", "Traceback ...", KeyError("id")).as_instanceof_cause()
    assert explain(bug)[1].startswith("pjray: internal error: KeyError: 'id'")


def test_an_actor_whose_constructor_raised_is_read_from_its_text():
    from ray.exceptions import RayActorError

    text = "The actor died because of an error raised in its creation task, ...\n  File ...\n"
    died = RayActorError(
        error_msg=text + "pjray.data.sources.DataError: rows.parquet row 4: empty image", actor_init_failed=True
    )
    assert explain(died) == (EXIT_INPUT, "pjray: bad data: rows.parquet row 4: empty image")
    bug = RayActorError(error_msg=text + "ZeroDivisionError: division by zero", actor_init_failed=True)
    assert explain(bug)[0] == EXIT_BUG and explain(bug)[1].startswith(
        "pjray: internal error: ZeroDivisionError: division by zero"
    )


def test_an_input_error_re_raised_as_something_else_is_still_input():
    try:
        try:
            raise DataError("rows.jsonl line 2: not JSON")
        except DataError as err:
            raise RuntimeError("read task failed") from err
    except RuntimeError as outer:
        assert explain(outer) == (EXIT_INPUT, "pjray: bad data: rows.jsonl line 2: not JSON")


# ----------------------------------------------------------------------------- paths


def test_hub_ids_are_owner_slash_name_with_no_such_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct")
    assert not is_hub_id("runs/demo/hf_model")  # two slashes
    assert not is_hub_id("./hf_model") and not is_hub_id("/abs/model") and not is_hub_id("../x/y")
    assert not is_hub_id("hf_model")  # no owner
    (tmp_path / "runs").mkdir()
    assert not is_hub_id("runs/hf_modle")  # "runs" is a local folder: a typo, not a repo


def test_a_typo_in_a_local_model_path_says_no_such_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    with pytest.raises(PathError, match=r"^eval.judge: runs/demo/hf_modle: no such directory"):
        check_model("eval.judge", "runs/demo/hf_modle")
    (tmp_path / "runs" / "demo" / "empty").mkdir()
    with pytest.raises(PathError, match="not a model directory"):
        check_model("eval.judge", "runs/demo/empty")
    check_model("eval.judge", str(fake_judge(tmp_path / "judge")))


def test_a_hub_id_the_hub_cannot_confirm_is_an_input_error(tmp_path, monkeypatch):
    # Offline this cannot reach the hub, online the repo does not exist: both say so in one line.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PathError, match=r"^model.path: pjray-no-such-owner/no-such-judge: no such directory, and"):
        check_model("model.path", "pjray-no-such-owner/no-such-judge")


@pytest.mark.parametrize(
    "command, overrides, message",
    [
        (
            "train",
            ["data.source=parquet", "data.path=missing/rows.parquet"],
            "data.path: missing/rows.parquet: no such file or directory",
        ),
        ("train", ["model.path=runs/x/hf_model"], "model.path: runs/x/hf_model: no such directory"),
        ("sft", ["sft.source=jsonl", "sft.path=chats.jsonl"], "sft.path: chats.jsonl: no such file"),
        (
            "ppjd",
            ["ppjd.source=jsonl", "ppjd.paths=[rows.jsonl]", "ppjd.vqa_backend=vlm", "ppjd.vlm_model=./judge"],
            "ppjd.paths: rows.jsonl: no such file",
        ),
        ("ppjd", ["ppjd.decontam_files=[bench/pair.jsonl]"], "ppjd.decontam_files: bench/pair.jsonl: no such file"),
        ("eval", ["eval.judge=./judge", "eval.image_dir=imgs"], "eval.image_dir: imgs: no such directory"),
        (
            "train",
            ["data.source=hf", "data.path=runs/x/ppjd"],
            "data.path: runs/x/ppjd: no such file or directory (and not a hub id",
        ),
        (
            "eval",
            ["eval.judge=./judge", "eval.data=bench/x/pair"],
            "eval.data: bench/x/pair: no such file or directory (and not a hub id",
        ),
    ],
)
def test_every_path_a_command_names_is_checked(command, overrides, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_judge(tmp_path / "judge")
    with pytest.raises(PathError) as err:
        check_inputs(load(None, ["model.init=tiny", *overrides]), command)
    assert str(err.value).startswith(message)


# ----------------------------------------------------------------------------- the CLI, in process


def test_train_with_a_missing_data_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["train", "model.init=tiny", "data.source=parquet", "data.path=nope.parquet"], capsys)
    assert (code, err) == (2, ["pjray: data.path: nope.parquet: no such file or directory"])


def test_eval_with_a_typo_in_the_judge_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    code, err = run_cli(["eval", "--judge", "runs/demo/hf_modle", "--bench", "perceptual_bias"], capsys)
    assert code == 2 and err == [
        "pjray: eval.judge: runs/demo/hf_modle: no such directory (and not a hub id owner/name)"
    ]


def test_eval_with_a_malformed_jsonl_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = (FIXTURES / "pair.jsonl").read_text().splitlines()
    data = tmp_path / "pair.jsonl"
    data.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    judge = fake_judge(tmp_path / "judge")
    code, err = run_cli(
        [
            "eval",
            "--judge",
            str(judge),
            "--bench",
            "pair",
            "--data",
            str(data),
            "--image-dir",
            str(FIXTURES),
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 2 and len(err) == 1  # 1 of 4 lines is more than the default 1%
    assert err[0].startswith(
        f"pjray: bad data: {data}: 1 of 4 rows are bad (more than data.max_reject_fraction=0.01): {data} line 2: not JSON"
    )


def test_train_on_a_parquet_with_too_many_bad_rows(tmp_path, monkeypatch, capsys, tiny_judge):
    from pjray.data.sources import write_items
    from pjray.ppjd.perturb import scene_items

    monkeypatch.chdir(tmp_path)
    items = scene_items(3, seed=0, num_candidates=3, image_size=64)
    items[1] = dataclasses.replace(items[1], image=items[1].image[:50])  # a truncated PNG
    write_items(items, tmp_path / "rows.parquet")
    code, err = run_cli(
        [
            "train",
            f"model.path={tiny_judge}",
            "data.source=parquet",
            "data.path=rows.parquet",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "pjray: bad data: rows.parquet: 1 of 3 rows are bad (more than data.max_reject_fraction=0.01): "
        "rows.parquet row 1: could not decode image"
    )


def test_train_on_a_dataset_without_the_ppjd_columns(tmp_path, monkeypatch, capsys, tiny_judge):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "hf_cache")
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "train.jsonl").write_text(
        json.dumps({"prompt": "q?", "img": "a.png", "chosen": "a", "rejected": "b"}) + "\n"
    )
    code, err = run_cli(
        [
            "train",
            f"model.path={tiny_judge}",
            "data.source=hf",
            "data.path=pairs",
            "data.num_candidates=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    assert (code, err) == (
        2,
        [
            "pjray: bad data: pairs [train]: no column for image, question (columns: prompt, img, chosen, rejected); name "
            "yours with data.columns.image=COLUMN"
        ],
    )
    code, err = run_cli(
        [
            "train",
            f"model.path={tiny_judge}",
            "data.source=hf",
            "data.path=pairs",
            "data.split=test",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    assert (code, err) == (2, ["pjray: data.split: test: no such split of pairs (splits: train)"])


def test_eval_on_a_hub_dataset_the_hub_cannot_confirm(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    fake_judge(tmp_path / "judge")
    code, err = run_cli(
        ["eval", "--judge", "judge", "--bench", "pair", "--data", "pjray-no-such-owner/mllm-judge"], capsys
    )
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "pjray: eval.data: pjray-no-such-owner/mllm-judge: no such folder, and not in the datasets "
        "cache; the hub could not be asked"
    )


def test_publishing_without_a_token_fails_before_the_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr("huggingface_hub.constants.HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    code, err = run_cli(["ppjd", "--push-to-hub", "me/ppjd", f"ppjd.output_dir={tmp_path / 'out'}"], capsys)
    assert (code, err) == (
        2,
        [
            "pjray: ppjd.push_to_hub: me/ppjd: no Hugging Face token to publish with (set HF_TOKEN "
            "or run `hf auth login`)"
        ],
    )
    assert not (tmp_path / "out").exists()


def test_config_errors_keep_their_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["train", "--config", "nope.yaml"], capsys) == (2, ["pjray: --config: nope.yaml: no such file"])
    code, err = run_cli(["ppjd", "ppjd.num_item=3"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("pjray: bad config: ppjd.num_item:")


def test_sweep_checks_every_trials_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(
        [
            "sweep",
            "--sweep-dir",
            str(tmp_path / "s"),
            "model.init=tiny",
            "data.source=parquet",
            "data.path=gone.parquet",
            "--grid",
            "trainer.seed=0,1",
        ],
        capsys,
    )
    assert (code, err) == (2, ["pjray: data.path: gone.parquet: no such file or directory"])
    assert not (tmp_path / "s").exists()


def test_a_bug_exits_1_and_debug_prints_the_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def broken(cfg, command):
        raise TypeError("check_inputs() got confused")

    monkeypatch.setattr("pjray.cli.check_inputs", broken)
    code, err = run_cli(["train", "model.init=tiny"], capsys)
    assert code == 1 and len(err) == 1
    assert err[0].startswith("pjray: internal error: TypeError: check_inputs() got confused") and "--debug" in err[0]
    code, err = run_cli(["train", "--debug", "model.init=tiny"], capsys)
    assert code == 1 and err[0].startswith("Traceback") and err[-1].startswith("pjray: internal error: TypeError")
    monkeypatch.setenv("PJRAY_DEBUG", "1")
    code, err = run_cli(["--debug", "train", "model.init=tiny"], capsys)
    assert code == 1 and any("in broken" in line for line in err)


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = next(line for line in out.splitlines() if line.startswith("Command line"))
    for command in ("train", "sft", "ppjd", "eval", "sweep"):
        assert f" {command} " in description.replace("|", " ") + " "
        assert f"    {command} " in out  # and its own line in the list


# ----------------------------------------------------------------------------- the console script


def test_the_console_shows_one_line_and_starts_no_cluster(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pjray",
            "train",
            "model.init=tiny",
            "data.source=parquet",
            f"data.path={tmp_path}/x.parquet",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"pjray: data.path: {tmp_path}/x.parquet: no such file or directory"]
    assert proc.stdout == ""
    assert time.perf_counter() - start < 20  # no Ray start-up (that alone takes ~10 s here)
