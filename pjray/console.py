"""What a training prints on the console: one line per step, a summary at the end, and none of
the notices of the stack below that a user can do nothing about (`--verbose` keeps them)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Set by `--verbose`; read here and by pjray.cluster.actor_env, so actors keep their warnings too.
VERBOSE_ENV = "PJRAY_VERBOSE"
# huggingface_hub's switch for its progress bars, which transformers' follow (model loads, shard writes).
NO_PROGRESS_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"

# Warnings the actors print on every run that the user cannot act on: about choices pjray made
# on purpose (weight buckets are sent zero-copy and only ever copied by receivers, pjray.sync),
# and DeepSpeed's ZeRO-3 calling torch.distributed functions torch has deprecated (dozens a
# step). PYTHONWARNINGS syntax: action:message-prefix, comma separated.
ACTOR_WARNING_FILTERS = ",".join(
    [
        "ignore:Zero-copy tensor serialization is enabled",
        "ignore:The given NumPy array is not writable",
        "ignore:`torch.distributed.",
    ]
)


def quiet_actor_warnings() -> None:
    """ACTOR_WARNING_FILTERS again, inside an actor that sends tensors: Ray puts its own "once"
    filter for the zero-copy warning ahead of the PYTHONWARNINGS ones when it is imported."""
    if not verbose():
        for rule in ACTOR_WARNING_FILTERS.split(","):
            warnings.filterwarnings("ignore", message=rule.removeprefix("ignore:"))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)

    def __eq__(self, other: object) -> bool:  # so that a second call adds no second filter
        return isinstance(other, _DropNotice) and other.prefix == self.prefix

    def __hash__(self) -> int:
        return hash(self.prefix)


def quiet_stack() -> None:
    """Silence the driver-side notices (`--verbose` leaves them): Ray's note that a local
    cluster uses token authentication (its default; the warning that auth is *disabled* stays),
    Ray Data's operator-name truncation warning, transformers' per-load progress bars (also in
    the actors: pjray.cluster.actor_env), and, when the console is not a terminal, the colours of
    the actors' log prefixes and `datasets`' progress bars (preparing and reading a dataset).
    Ray's and Ray Data's INFO lines: pjray.cluster.connect and `quiet_ray_data`."""
    if verbose():
        return
    os.environ.setdefault(NO_PROGRESS_BARS_ENV, "1")  # read by huggingface_hub and transformers on import
    if not sys.stderr.isatty():
        import datasets

        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no colour codes in the actors' log prefixes
        datasets.disable_progress_bars()
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _DropNotice("Token authentication is enabled")
    )
    logging.getLogger("ray.data._internal.progress.utils").addFilter(_DropNotice("Truncating long operator name"))


def quiet_ray_data() -> None:
    """Ray Data's INFO lines (execution plans, progress blocks) and its notice that progress
    bars are off stay in the session's ray-data.log, off the console, unless `--verbose`; pjray
    logs its own progress lines.
    Call after `import ray.data` (which sets up its console handler)."""
    if verbose():
        return
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    # Its warning that progress bars are off: pjray turned them off, for its own lines.
    logging.getLogger("ray.data._internal.progress").addFilter(_DropNotice("Progress bars disabled"))
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class PhaseClock:
    """Logs each set-up phase that took a second or more (`clock.done("learners")` after it),
    so a slow start-up says where its time goes and a fast one stays quiet."""

    def __init__(self, logger: logging.Logger, min_s: float = 1.0) -> None:
        self.logger, self.min_s = logger, min_s
        self.last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        took, self.last = now - self.last, now
        if took >= self.min_s:
            self.logger.info("set-up: %s %.1fs", phase, took)


class StallWatch:
    """Says on the console when a run stops learning for a reason a setting fixes: for `window`
    steps in a row, more than half the responses cut at rollout.max_new_tokens (they score 0
    unless reward.score_truncated), or more than 90% of the groups with all-equal rewards (no
    gradient). One line per streak, saying what to change."""

    CUT, FLAT = 0.5, 0.9

    def __init__(self, max_new_tokens: int, window: int = 5) -> None:
        self.max_new_tokens, self.window = max_new_tokens, window
        self.cut_streak = self.flat_streak = 0

    def update(self, metrics: dict[str, float]) -> list[str]:
        cut, flat = metrics.get("response_length/clip_ratio", 0.0), metrics.get("rollout/frac_zero_std", 0.0)
        self.cut_streak = self.cut_streak + 1 if cut > self.CUT else 0
        self.flat_streak = self.flat_streak + 1 if flat > self.FLAT else 0
        lines = []
        if self.cut_streak == self.window:
            lines.append(
                f"{self.window} steps in a row with more than half the responses cut at rollout.max_new_tokens="
                f"{self.max_new_tokens} ({cut:.0%} at this step): a cut response scores 0; raise "
                "rollout.max_new_tokens (and rollout.max_model_len), or add reward.overlong_buffer"
            )
        if self.flat_streak == self.window:
            lines.append(
                f"{self.window} steps in a row with more than 90% of the groups' rewards all equal ({flat:.0%} "
                "at this step): they carry no gradient; raise algo.group_size or rollout.temperature, or set "
                "algo.filter_zero_std=true"
            )
        return lines


def step_line(step: int, total: int, metrics: dict[str, float], seconds_per_step: float) -> str:
    """`step 13/20  reward 0.412  format 0.950  ranking 0.433  1.1s/step  ETA 8s`."""
    return (
        f"step {step}/{total}  reward {metrics['reward/mean']:.3f}  format {metrics['reward/format_mean']:.3f}  "
        f"ranking {metrics['reward/ranking_mean']:.3f}  {metrics['timing_s/step']:.1f}s/step  "
        f"ETA {duration(seconds_per_step * (total - step))}"
    )


SUMMARY_WINDOW = 5  # steps averaged at each end of the run in the summary
BEST = "best.json"  # in a run dir: trainer.keep_best's best step, value and judge (pjray.rl.best)
HELD_OUT = "held_out.json"  # in a run dir: the held-out check of a run from the base judge
HELD_OUT_ITEMS = "held_out_items.parquet"  # ... and its verdicts, one row per judge and item
DATA_REJECTS = "data_rejects.jsonl"  # in a run dir: the training rows left out, one JSON object a line
PREFILTERED = "prefiltered_items.jsonl"  # in a run dir: the items algo.prefilter_zero_std left out, with their reward


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def held_out_lines(check: dict[str, Any]) -> list[str]:
    """The held-out check (pjray.eval.held_out.held_out_check), base judge -> trained judge:
    correct first, format and reward, then per question kind correct first, image-following with
    its interval and null, the paired swap test, the paired test against the base judge's forced
    ceiling, the blank control and the "by the image" disposition rate; last, the blank control's
    paired change against the forced base judge."""
    base, trained = check["base"], check["trained"]
    b, t = base["ranking"], trained["ranking"]
    lines = [
        f"  held-out check ({check['tuples']} independent tuples held out by content, letters balanced, greedy; "
        f"base judge -> this run): correct first {b['correct_first']:.0%} -> {t['correct_first']:.0%}, "
        f"format {b['format']:.0%} -> {t['format']:.0%}, reward {b['reward']:.3f} -> {t['reward']:.3f}"
    ]
    parts = [s for s in trained["looks"] if s in ("taught", "untaught") or "/" in s]
    for kind, tl in trained["looks"].items():
        if kind == "pooled" or kind in parts:
            continue
        bl, null, swap = base["looks"][kind], tl["nulls"], tl["swap_test"]
        (lo, hi), ceiling = tl["image_following_ci"], check["ceiling_test"][kind]
        forced = bl["forced"] or {}
        lines += [
            f"    {kind} ({tl['items']}): correct first {bl['correct_first']:.0%} -> {tl['correct_first']:.0%}; "
            f"image-following {bl['image_following']:.0%} -> {tl['image_following']:.0%} [{lo:.0%}, {hi:.0%}] "
            f"(null {null['drop_contradicting']:.0%}); perception error first, original -> swapped image "
            f"{swap['perception_error_first_original']:.0%} -> {swap['perception_error_first_swapped']:.0%} "
            f"(paired swap test p {swap['p']:.2g})",
            f"      against the base judge forced by the image (image-following {ceiling['forced_base']:.0%}, correct first "
            f"{forced.get('correct_first', 0):.0%}): {ceiling['b']} items only this run follows, {ceiling['c']} only the "
            f"forced base judge (McNemar p {ceiling['p']:.2g})",
            f"      blank image: correct first {bl['blank_correct_first']:.0%} -> {tl['blank_correct_first']:.0%}"
            f" (forced base judge {forced.get('blank_correct_first', 0):.0%})"
            # a base judge of one disposition writes no "Verdict: by ..." sentence to count
            + (
                f'; "by the image" {bl["disposition_image"]:.0%} -> {tl["disposition_image"]:.0%}'
                if check.get("disposition", True)
                else ""
            ),
        ]
    for part in parts:  # the base judge's taught and untaught values (its recipe's `untaught`)
        bl, tl = base["looks"][part], trained["looks"][part]
        (lo, hi), ceiling = tl["image_following_ci"], check["ceiling_test"][part]
        lines.append(
            f"    {part} ({tl['items']}): image-following {bl['image_following']:.0%} -> {tl['image_following']:.0%} "
            f"[{lo:.0%}, {hi:.0%}]; paired swap test p {tl['swap_test']['p']:.2g}; against the base judge "
            f"({ceiling['forced_base']:.0%}): McNemar p {ceiling['p']:.2g}"
        )
    change = check["blank_change"]["pooled"]
    shortcut = "a text shortcut" if change["lo"] > 0 else "no text shortcut shown"
    lines.append(
        f"    blank image, this run - the forced base judge: correct first {change['mean']:+.0%} [{change['lo']:+.0%}, "
        f"{change['hi']:+.0%}] ({shortcut}); image-following's null: "
        f"{trained['looks']['pooled']['nulls']['drop_contradicting']:.0%}, a judge that drops the self-contradicting "
        "answer and guesses per image"
    )
    return lines


def run_summary(run_dir: Path, wall_s: float) -> list[str]:
    """The end of `pjray train`: steps and reward first -> last (from metrics.jsonl), wall time,
    the held-out check of a run from the base judge (held_out.json), where the run, its HF
    export and its W&B run are."""
    rows: list[dict[str, Any]] = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = [f"pjray: run finished in {duration(wall_s)}: {run_dir}"]
    if rows:
        # Means over the first and last few steps: one step's reward is a noisy sample.
        k = max(1, min(SUMMARY_WINDOW, len(rows) // 2))
        head, tail = rows[:k], rows[-k:]
        span = f"steps {head[0]['step']}-{head[-1]['step']} -> {tail[0]['step']}-{tail[-1]['step']}"
        if k == 1:
            span = f"step {head[0]['step']} -> {tail[0]['step']}"
        learned = [
            f"{name} {mean(head, key):.3f} -> {mean(tail, key):.3f} ({mean(tail, key) - mean(head, key):+.3f})"
            for name, key in (("reward", "reward/mean"), ("format", "reward/format_mean"))
            if all(key in r for r in rows)
        ]
        lines.append(f"  {', '.join(learned)} (mean of {span}, {len(rows)} steps logged)")
        if rows[-1].get("data/rejected"):
            lines.append(
                f"  training rows skipped: {int(rows[-1]['data/rejected'])} (each with its reason in {run_dir / DATA_REJECTS})"
            )
        if (run_dir / PREFILTERED).is_file():
            dropped = len((run_dir / PREFILTERED).read_text(encoding="utf-8").splitlines())
            lines.append(
                f"  items left out before step 1, every response of the base policy's group earning the same reward "
                f"(algo.prefilter_zero_std): {dropped} (listed in {run_dir / PREFILTERED}); the reward is over the rest"
            )
        if all("response_length/clip_ratio" in r and "rollout/frac_zero_std" in r for r in rows):
            lines.append(
                f"  responses cut at rollout.max_new_tokens: {mean(rows, 'response_length/clip_ratio'):.0%}; "
                f"groups with all-equal rewards (no gradient): {mean(rows, 'rollout/frac_zero_std'):.0%} (mean over steps)"
            )
    held_out = run_dir / HELD_OUT
    if held_out.is_file():
        check = json.loads(held_out.read_text(encoding="utf-8"))
        lines += held_out_lines(check)
    if (run_dir / BEST).is_file():
        best = json.loads((run_dir / BEST).read_text(encoding="utf-8"))
        lines.append(
            f"  best validation: {best['metric']} = {best['value']:.4f} at step {best['step']} "
            f"({best['mode']}; judge in {best['model']})"
        )
    if (run_dir / "hf_model" / "config.json").is_file():
        lines.append(f"  HF export: {run_dir / 'hf_model'}")
    run_id = run_dir / "wandb_run_id"
    if run_id.is_file():
        lines.append(f"  W&B run: {run_id.read_text().strip()} (files in {run_dir / 'wandb'}; offline: `wandb sync`)")
    return lines
