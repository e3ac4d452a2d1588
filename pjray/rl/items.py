"""The training items a run reads: a PPJD parquet (file or folder) or a dataset (data.source=hf),
each row checked, without the items whose prompt leaves no room for a response, and with
algo.prefilter_zero_std without those the initial policy's groups score alike."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from pjray.config import Config, ConfigError
from pjray.console import PREFILTERED
from pjray.data.hf import DatasetItems, StreamSampler, StreamState, open_dataset, train_ref
from pjray.data.prompts import render_batch
from pjray.data.sampler import ItemSampler, SamplerState
from pjray.data.sources import RowReject, Rows, scan_items, write_rejects
from pjray.models.loading import processor_inputs, render_chat
from pjray.rl.collect import Collector, mean, prefiltered, zero_variance_items
from pjray.types import JudgeItem

log = logging.getLogger(__name__)


def training_items(cfg: Config, path: str) -> Rows[JudgeItem] | DatasetItems:
    """The rows at `path` (a PPJD parquet, or with data.source=hf the dataset data.* names), each
    row checked; fails when more than data.max_reject_fraction are bad. A streamed dataset
    (data.streaming) comes back unread, as `DatasetItems`: its rows are checked as the sampler
    reads them."""
    if cfg.data.source == "hf":
        items = DatasetItems(
            open_dataset(train_ref(cfg.data), cfg.data.streaming), cfg.data.columns, cfg.data.num_candidates, path
        )
        if cfg.data.streaming:
            return items
        rows = items.scan()
    else:
        rows = scan_items(path, cfg.data.num_candidates)
    rows.check(cfg.data.max_reject_fraction)
    return rows


def overlong(item: JudgeItem, processor: Any, cfg: Config) -> str | None:
    """Why `item` cannot be trained on, when its prompt as the engines see it (chat template,
    image expanded into its tokens under the image budget) leaves less than
    rollout.max_new_tokens within rollout.max_model_len; None when it fits (verl's
    filter_overlong_prompts: vLLM would fail the whole generate call for one such prompt)."""
    prompt = render_batch(item, None, style=cfg.reward.style, shown=tuple(range(len(item.candidates))))
    image = prompt.image if cfg.data.images else None
    text = render_chat(processor, dataclasses.replace(prompt, image=image), think_prefix=cfg.model.think_prefix)
    length = int(processor_inputs(processor, [text], [image])["input_ids"].shape[1])
    if length + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len:
        return None
    return (
        f"prompt of {length} tokens + rollout.max_new_tokens={cfg.rollout.max_new_tokens} > "
        f"rollout.max_model_len={cfg.rollout.max_model_len} (lower model.max_pixels, or raise max_model_len)"
    )


def drop_overlong(rows: Rows[JudgeItem], processor: Any, cfg: Config) -> Rows[JudgeItem]:
    """`rows` without the items that are `overlong`, which move to the rejects with the reason."""
    kept, rejects = [], list(rows.rejects)
    for item in rows.rows:
        reason = overlong(item, processor, cfg)
        if reason is None:
            kept.append(item)
        else:
            rejects.append(RowReject(where=f"{rows.source} item {item.id}", row_id=item.id, reason=reason))
    return Rows(rows.source, kept, rejects)


def usable_rows(rows: Rows[JudgeItem], processor: Any, cfg: Config, rejects: Path) -> Rows[JudgeItem]:
    """`rows` without the `overlong` items, checked again against data.max_reject_fraction; every
    skipped row is listed in `rejects`."""
    rows = drop_overlong(rows, processor, cfg)
    rows.check(cfg.data.max_reject_fraction)
    write_rejects(rows.rejects, rejects)
    if rows.rejects:
        log.warning(
            "%d of %d training rows skipped (listed in %s), e.g. %s: %s",
            len(rows.rejects),
            len(rows.rows) + len(rows.rejects),
            rejects,
            rows.rejects[0].where,
            rows.rejects[0].reason,
        )
    return rows


def item_sampler(data: Rows[JudgeItem] | DatasetItems, cfg: Config, processor: Any, saved: dict, rejects: Path) -> Any:
    """The sampler over the items, from a checkpoint's state (`saved`) or the start: shuffled
    epochs over rows in memory, or a stream whose bad rows go to `rejects` as it reads them."""
    if isinstance(data, Rows):
        return ItemSampler(data.rows, cfg.trainer.seed, SamplerState(**saved))
    return StreamSampler(
        data,
        StreamState(**saved),
        rejects,
        cfg.data.max_reject_fraction,
        reject=lambda item: overlong(item, processor, cfg),
    )


def prefilter(
    data: Rows[JudgeItem] | DatasetItems,
    cfg: Config,
    run_dir: Path,
    resumed: bool,
    processor: Any,
    rollout: Any,
    task: Any,
) -> Rows[JudgeItem] | DatasetItems:
    """With algo.prefilter_zero_std, `data` without the items whose group, sampled by the current
    (initial) policy on the `rollout` pool and scored as the `task` scores it, earns one reward in
    every response (`zero_variance_items`, `prefiltered`), each listed in
    <run_dir>/prefiltered_items.jsonl with that reward; else `data`. Decided once, before step 1:
    a resumed run reads the list (the held-out check still keeps every training item, left out or
    not, out of its scenes)."""
    if not cfg.algo.prefilter_zero_std:
        return data
    assert isinstance(data, Rows)  # config: not with data.streaming
    path = run_dir / PREFILTERED
    if resumed:
        if not path.is_file():
            raise ConfigError(
                f"algo.prefilter_zero_std: the run being resumed has no {path} (it started without the "
                "prefilter); resume it with algo.prefilter_zero_std=false or start a new run"
            )
        left_out = {json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()}
        return Rows(data.source, prefiltered(data.rows, left_out), data.rejects)
    started = time.perf_counter()
    everything = Collector(cfg, ItemSampler(data.rows, cfg.trainer.seed), processor, rollout, task)
    flat = zero_variance_items(everything, len(data.rows))
    kept = prefiltered(data.rows, flat)
    if len(kept) == len(data.rows) and flat:
        log.warning(
            "algo.prefilter_zero_std: every one of the %d training items earns one reward in all %d responses of the "
            "initial policy (mean %.3f): it has nothing to learn from; training on all of them",
            len(flat),
            cfg.algo.group_size,
            mean(list(flat.values())),
        )
        flat = {}
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": i,
                    "reward": r,
                    "reason": "every response of the initial policy's group earned this reward (no GRPO gradient)",
                }
            )
            + "\n"
            for i, r in flat.items()
        )
    )
    log.info(
        "algo.prefilter_zero_std: %d of %d training items left out in %.1fs, every response of the initial policy "
        "earning one reward (listed in %s)",
        len(flat),
        len(data.rows),
        time.perf_counter() - started,
        path,
    )
    return Rows(data.source, kept, data.rejects)
