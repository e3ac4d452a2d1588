"""`pjray sft`: supervised fine-tuning of a judge on chat examples, on the GRPO learner.

The same `LearnerRank` DeepSpeed ranks, in the same kind of Ray placement group, train with
`LearnerRank.sft_step` (token-mean NLL of the response tokens only; the prompt, image tokens
and padding carry no loss). The driver reads top to bottom: examples -> experiences ->
`sft.steps` optimizer steps over shuffled epochs -> checkpoints -> HF export.

Examples come from a JSONL or parquet file of chat rows (`system`, `user`, `response`, and an
optional `image`: encoded bytes, or in JSONL a path relative to the file), or from the base
judge recipe's scene mixture (`pjray.models.base_judge`). A row without a response or with an
image that does not decode is a data error naming the file and row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from pjray.cluster import connect
from pjray.config import AlgoConfig, Config, ConfigError, to_dict
from pjray.data.images import decode_image
from pjray.errors import InputError
from pjray.models.loading import load_processor, render_chat
from pjray.placement import Placement, RoleResources
from pjray.rl.learner import LearnerRank
from pjray.tracking import Tracker
from pjray.types import ChatExample, Experience, JudgePrompt

log = logging.getLogger(__name__)

__all__ = ["SFTDataError", "read_chat_examples", "run_sft", "to_experience"]


class SFTDataError(InputError):
    """A chat-example row that cannot be trained on; the message names the file and row."""

    what = "bad data"


def read_chat_examples(path: str | Path, source: str) -> list[ChatExample]:
    """The chat examples of a JSONL or parquet file of chat rows (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: no such file")
    rows: list[dict[str, Any]]
    if source == "jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SFTDataError(f"{path}: line {n}: not JSON ({err.msg})") from None
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    out = []
    for n, row in enumerate(rows, 1):
        where = f"{path}: row {n}"
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("user"), str)
            or not isinstance(row.get("response"), str)
        ):
            raise SFTDataError(f"{where}: needs string fields 'user' and 'response'")
        image = row.get("image")
        if isinstance(image, str):  # a path, relative to the file
            image_path = path.parent / image
            if not image_path.is_file():
                raise SFTDataError(f"{where}: image {image!r}: no such file")
            image = image_path.read_bytes()
        if image is not None:
            try:
                decode_image(image)
            except ValueError as err:
                raise SFTDataError(f"{where}: {err}") from None
        prompt = JudgePrompt(
            item_id=str(row.get("id", n)),
            system=str(row.get("system") or ""),
            user=row["user"],
            image=image,
            protocol="chat",
            style="answer",
            num_candidates=0,
            shown=(),
            target="",
        )
        out.append(ChatExample(prompt, row["response"]))
    if not out:
        raise SFTDataError(f"{path}: no chat examples")
    return out


def to_experience(processor: Any, example: ChatExample, think_prefix: bool) -> Experience:
    """The learner's input for one example: the rendered prompt and the response's token ids,
    closed with the end-of-turn token (the judge learns to stop); the tokens that overlap the
    example's untrained span carry no loss."""
    text = render_chat(processor, example.prompt, think_prefix=think_prefix)
    tok = processor.tokenizer
    untrained = example.untrained
    enc = tok(example.response + tok.eos_token, add_special_tokens=False, return_offsets_mapping=untrained is not None)
    mask = None
    if untrained is not None:
        start, end = untrained
        if not 0 <= start < end <= len(example.response):
            raise SFTDataError(
                f"example {example.prompt.item_id}: untrained span {untrained} is not inside the response"
            )
        mask = tuple(not (a < end and b > start) for a, b in enc.offset_mapping)
    return Experience(text, example.prompt.image, tuple(enc.input_ids), advantage=0.0, loss_mask=mask)


def _examples(cfg: Config) -> list[ChatExample]:
    if cfg.sft.source == "base_judge":
        from pjray.models.base_judge import BaseJudgeRecipe, sft_examples

        recipe = BaseJudgeRecipe(seed=cfg.trainer.seed)
        return sft_examples(recipe, cfg.sft.num_scenes, recipe.seed)
    return read_chat_examples(cfg.sft.path, cfg.sft.source)


def run_sft(cfg: Config, model_path: str, examples: list[ChatExample] | None = None) -> Path:
    """Fine-tune the judge at `model_path` as `cfg.sft` says, on `examples` when given (else
    those `cfg.sft` names); returns the HF export's path."""
    run_dir = Path(cfg.trainer.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    chosen = examples if examples is not None else _examples(cfg)
    processor = load_processor(model_path, cfg.model.image_budget)
    experiences = [to_experience(processor, e, cfg.model.think_prefix) for e in chosen]
    log.info("sft: %d examples", len(experiences))
    connect(cfg.ray)

    lc, s = cfg.learner, cfg.sft
    if s.batch_size % (lc.num_ranks * (1 if lc.micro_batch_tokens else lc.micro_batch_size)):
        raise ConfigError(
            f"sft.batch_size={s.batch_size}: must split into learner.num_ranks {lc.num_ranks} x "
            f"learner.micro_batch_size {lc.micro_batch_size}"
        )
    learner_cfg = dataclasses.replace(lc, lr=s.lr, warmup_steps=s.warmup_steps, lr_schedule=s.lr_schedule)
    placement = Placement(
        {"learner": RoleResources(lc.num_ranks, lc.num_cpus_per_rank, lc.num_gpus_per_rank)},
        strategy=cfg.ray.placement_strategy,
        timeout_s=cfg.ray.placement_timeout_s,
    )
    addr, port = placement.master_address("learner")
    per_rank = s.batch_size // lc.num_ranks
    threads = placement.threads("learner", lc.num_threads)
    ranks = [
        placement.launch(
            "learner",
            LearnerRank,
            r,
            cfg.model,
            learner_cfg,
            AlgoConfig(kl_coef=0.0),
            model_path,
            rank=r,
            world_size=lc.num_ranks,
            master_addr=addr,
            master_port=lc.master_port or port,
            total_steps=s.steps,
            grad_accum_steps=max(1, per_rank // lc.micro_batch_size),
            num_threads=threads[r],
        )
        for r in range(lc.num_ranks)
    ]
    ray.get([r.ready.remote() for r in ranks])
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    tracker = Tracker(cfg.tracking, run_dir, to_dict(cfg), resume=False)

    order: list[int] = []
    epoch = 0
    loop_started = time.perf_counter()  # the ETA counts steps only, not the set-up above
    try:
        for step in range(1, s.steps + 1):
            t0 = time.perf_counter()
            while len(order) < s.batch_size:  # shuffled epochs, reproducible for the seed
                fresh = list(range(len(experiences)))
                random.Random(f"pjray.sft:{cfg.trainer.seed}:{epoch}").shuffle(fresh)
                order += fresh
                epoch += 1
            batch = [experiences[i] for i in order[: s.batch_size]]
            del order[: s.batch_size]
            tokens = float(sum(_trained_tokens(e) for e in batch))
            # Each rank's shard sorted by length: its micro-batches then pad to similar lengths
            # (the loss is a token mean over the whole batch, so the order does not change it).
            shards = [sorted(batch[r * per_rank : (r + 1) * per_rank], key=_length) for r in range(lc.num_ranks)]
            metrics = ray.get([rank.sft_step.remote(shard, tokens) for rank, shard in zip(ranks, shards)])[0]
            metrics["timing_s/step"] = time.perf_counter() - t0
            metrics["sft/epoch"] = step * s.batch_size / len(experiences)
            tracker.log(metrics, step)
            if step == 1 or step % 25 == 0 or step == s.steps:
                eta = (time.perf_counter() - loop_started) / step * (s.steps - step)
                log.info(
                    "sft step %d/%d loss %.4f token_acc %.3f step %.2fs eta %.0fs",
                    step,
                    s.steps,
                    metrics["sft/loss"],
                    metrics["sft/token_acc"],
                    metrics["timing_s/step"],
                    eta,
                )
            if s.save_every and step % s.save_every == 0:
                path = run_dir / "checkpoints" / f"global_step_{step}"
                ray.get([r.save_checkpoint.remote(str(path / "learner"), {"step": step}) for r in ranks])
                (path / "COMPLETE").touch()
        export = run_dir / "hf_model"
        partial = run_dir / "hf_model.partial"
        shutil.rmtree(partial, ignore_errors=True)
        ray.get([r.save_hf.remote(str(partial)) for r in ranks])
        _copy_processor_files(Path(model_path), partial)
        shutil.rmtree(export, ignore_errors=True)
        partial.rename(export)
    finally:
        tracker.close()
        for r in ranks:
            ray.kill(r)
        placement.shutdown()
    log.info("sft: done in %.0fs; judge exported to %s", time.perf_counter() - started, export)
    return export


def _trained_tokens(e: Experience) -> int:
    return len(e.response_ids) if e.loss_mask is None else sum(e.loss_mask)


def _length(e: Experience) -> int:
    return len(e.prompt_text) + len(e.response_ids)


def _copy_processor_files(source: Path, target: Path) -> None:
    """The base checkpoint's processor files the export lacks (e.g. preprocessor_config.json)."""
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file() and not (target / name).exists():
            shutil.copy2(source / name, target / name)
