"""The paths a command names, checked before any cluster starts.

A missing file should cost the user a second, not a Ray start-up and a worker's traceback. Each
check raises `PathError` (`<key>: <path>: <why>`). A model is a local directory with a
config.json, or a hub id: `owner/name`, used as one only when no such local path exists and
`owner` is not a local folder either, and then only when the hub cache or the hub has it. Anything
else that does not exist is a typo'd local path, and is reported as one, not as a hub lookup. A
dataset (`data.source=hf`, `eval.data`) is a local folder or a hub id the same way; whether the
hub has it, its subset and split is asked when it is opened (pjray.data.hf), still before Ray.
"""

from __future__ import annotations

from pathlib import Path

from pjray.config import HUB_ID, Config, PathError, is_outputs_file

__all__ = ["check_inputs", "is_hub_id"]


def is_hub_id(value: str) -> bool:
    """Whether `value` names a hub repo rather than a local path: `owner/name`, with no such
    path here and no local folder `owner` (`runs/hf_modle` is a typo, not a repo of "runs")."""
    if not HUB_ID.fullmatch(value) or ".." in value or Path(value).exists():
        return False
    return not Path(value.split("/")[0]).exists()


def check_model(key: str, value: str) -> None:
    path = Path(value)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PathError(f"{key}: {value}: not a model directory (no config.json)")
        return
    if path.exists():
        raise PathError(f"{key}: {value}: not a directory (a model is a directory or a hub id owner/name)")
    if not is_hub_id(value):
        raise PathError(f"{key}: {value}: no such directory (and not a hub id owner/name)")
    check_hub_model(key, value)


def check_hub_model(key: str, repo: str) -> None:
    """A hub id must be in the local hub cache or on the hub, asked here once: otherwise every
    worker would retry the download and die with the hub client's traceback."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(repo, "config.json"), str):
        return
    try:
        huggingface_hub.model_info(repo, timeout=10)
    except RepositoryNotFoundError:
        raise PathError(f"{key}: {repo}: no such directory, and no such model on the hub") from None
    except Exception as err:  # noqa: BLE001 - offline, unreachable, refused: the workers could not load it either
        raise PathError(
            f"{key}: {repo}: no such directory, and not in the hub cache; the hub could not be asked "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no reply'})"
        ) from None


def check_file(key: str, value: str) -> None:
    path = Path(value)
    if path.is_dir():
        raise PathError(f"{key}: {value}: is a directory, expected a file")
    if not path.is_file():
        raise PathError(f"{key}: {value}: no such file")


def check_dir(key: str, value: str) -> None:
    if not Path(value).is_dir():
        why = "not a directory" if Path(value).exists() else "no such directory"
        raise PathError(f"{key}: {value}: {why}")


def check_exists(key: str, value: str) -> None:
    """A data path that may be a file or a folder of files."""
    if not Path(value).exists():
        raise PathError(f"{key}: {value}: no such file or directory")


def check_dataset(key: str, value: str, files: bool = False) -> None:
    """A dataset: a local folder or a hub id (asked for when it is loaded, still before Ray
    starts: pjray.data.hf.open_dataset); with `files`, also a local data file."""
    path = Path(value)
    if path.is_file() and not files:
        raise PathError(f"{key}: {value}: a file; a dataset is a folder or a hub id owner/name")
    if not path.exists() and not is_hub_id(value):
        raise PathError(f"{key}: {value}: no such file or directory (and not a hub id owner/name)")


def check_hub_token(key: str, repo: str) -> None:
    """Publishing needs a token; without one the job would fail only after building the dataset."""
    import huggingface_hub

    if huggingface_hub.get_token() is None:
        raise PathError(f"{key}: {repo}: no Hugging Face token to publish with (set HF_TOKEN or run `hf auth login`)")


def check_inputs(cfg: Config, command: str) -> None:
    """Every path `command` (train | sft | ppjd | eval) will read; raises `PathError` for the
    first that is missing."""
    if command in ("train", "sft") and cfg.model.path:
        check_model("model.path", cfg.model.path)
    if command == "train" and cfg.data.source == "parquet":
        check_exists("data.path", cfg.data.path)
    if command == "train" and cfg.data.source == "hf":
        check_dataset("data.path", cfg.data.path)
    if command == "train" and cfg.task.kind == "policy" and cfg.reward.source != "rule":
        if cfg.reward.judge.model != "shipped":
            check_model("reward.judge.model", cfg.reward.judge.model)
    if command == "train" and cfg.eval.every_steps and cfg.eval.train_bench != "perceptual_bias":
        check_dataset("eval.data", cfg.eval.data, files=True)
    if command == "sft" and cfg.sft.path:
        check_file("sft.path", cfg.sft.path)
    if command == "ppjd":
        p = cfg.ppjd
        for path in p.paths:
            check_file("ppjd.paths", path)
        if p.perturb_backend == "llm":
            check_model("ppjd.llm_model", p.llm_model)
            if p.llm_gguf_file and Path(p.llm_model).is_dir():
                check_file("ppjd.llm_gguf_file", str(Path(p.llm_model) / p.llm_gguf_file))
        if p.vqa_backend == "vlm":
            check_model("ppjd.vlm_model", p.vlm_model)
        for path in p.decontam_files:
            check_file("ppjd.decontam_files", path)
        if p.push_to_hub:
            check_hub_token("ppjd.push_to_hub", p.push_to_hub)
    if command == "eval":
        e = cfg.eval
        if e.judge:  # required: pjray.eval.runner.JudgeRunner says so
            check_model("eval.judge", e.judge)
        if e.data:
            check_dataset("eval.data", e.data, files=True)
        if e.image_dir:
            check_dir("eval.image_dir", e.image_dir)
        if e.outputs:
            check_file("eval.outputs", e.outputs)
        for name in e.compare:  # a judge or an outputs file
            if is_outputs_file(name):
                check_file("eval.compare", name)
            else:
                check_model("eval.compare", name)
