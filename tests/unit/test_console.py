"""The console of a training: a line per step, the end-of-run summary, quiet notices."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

from pjray.cluster import actor_env
from pjray.console import (
    ACTOR_WARNING_FILTERS,
    NO_PROGRESS_BARS_ENV,
    VERBOSE_ENV,
    PhaseClock,
    StallWatch,
    duration,
    quiet_ray_data,
    quiet_stack,
    run_summary,
    step_line,
)
from pjray.eval.looking import blank_change, ceiling_test, held_out_tuples, judge_looking, looking_items, looking_report

METRICS = {"reward/mean": 0.4123, "reward/format_mean": 0.95, "reward/ranking_mean": 0.4333, "timing_s/step": 1.14}


def test_step_line_has_progress_rewards_time_and_eta():
    assert step_line(13, 20, METRICS, seconds_per_step=1.2) == (
        "step 13/20  reward 0.412  format 0.950  ranking 0.433  1.1s/step  ETA 8s"
    )
    assert step_line(20, 20, METRICS, 1.2).endswith("ETA 0s")


def test_the_summary_reports_cut_responses_and_flat_groups(tmp_path):
    rows = [
        {"step": s, "reward/mean": 0.5, "response_length/clip_ratio": c, "rollout/frac_zero_std": z}
        for s, c, z in ((1, 0.5, 1.0), (2, 0.25, 0.5))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_summary(tmp_path, 1.0)[2] == (
        "  responses cut at rollout.max_new_tokens: 38%; groups with all-equal rewards (no gradient): 75% (mean over steps)"
    )


def test_a_run_that_cannot_learn_says_so_once_a_streak_and_what_to_change():
    watch = StallWatch(max_new_tokens=2048, window=3)
    cut = {"response_length/clip_ratio": 0.8, "rollout/frac_zero_std": 0.2}
    flat = {"response_length/clip_ratio": 0.0, "rollout/frac_zero_std": 0.95}
    assert [watch.update(cut) for _ in range(2)] == [[], []]
    [line] = watch.update(cut)
    assert line.startswith("3 steps in a row with more than half the responses cut at rollout.max_new_tokens=2048 (80%")
    assert "reward.overlong_buffer" in line
    assert watch.update(cut) == []  # once a streak
    assert watch.update(flat) == [] and watch.update(flat) == []
    [line] = watch.update(flat)
    assert "more than 90% of the groups' rewards all equal (95%" in line and "algo.filter_zero_std=true" in line
    watch.update({"response_length/clip_ratio": 0.1, "rollout/frac_zero_std": 0.1})  # a healthy step ends both
    assert watch.cut_streak == watch.flat_streak == 0


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3600, 7322)] == ["0s", "59s", "1m01s", "59m59s", "1h00m", "2h02m"]


def test_run_summary_names_the_reward_run_dir_export_and_wandb_run(tmp_path):
    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.25}, {"step": 3, "reward/mean": 0.5}]
    long = [{"step": s, "reward/mean": s / 10, "reward/format_mean": 0.5 + s / 40} for s in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hf_model").mkdir()
    (tmp_path / "hf_model" / "config.json").write_text("{}")
    (tmp_path / "wandb_run_id").write_text("abc123\n")
    assert run_summary(tmp_path, 125.0) == [
        f"pjray: run finished in 2m05s: {tmp_path}",
        "  reward 0.100 -> 0.500 (+0.400) (mean of step 1 -> 3, 3 steps logged)",
        f"  HF export: {tmp_path / 'hf_model'}",
        f"  W&B run: abc123 (files in {tmp_path / 'wandb'}; offline: `wandb sync`)",
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long))
    assert run_summary(tmp_path, 60.0)[1] == (
        "  reward 0.300 -> 1.000 (+0.700), format 0.575 -> 0.750 (+0.175) (mean of steps 1-5 -> 8-12, 12 steps logged)"
    )
    # The held-out check's lines, from the looking protocol's own report of two scripted judges
    # on 12 tuples a kind: the base judge keeps the order shown (forced: follows the image), the
    # trained judge follows the image.
    items = looking_items(held_out_tuples(12, seed=7, image_size=96, objects=(1, 1)), letters_seed=3)
    text, _ = judge_looking(
        lambda ps: ["Image: red. Verdict: by the text.\n</think>\n<answer>A > B > C</answer>"] * len(ps),
        items,
        forced=False,
    )
    base = [
        replace(v, forced=True, forced_original=v.best, forced_swapped=v.perception_error, forced_blank=v.best)
        for v in text
    ]
    trained = [replace(v, top_original=v.best, top_swapped=v.perception_error, by_image_original=True) for v in text]
    ranking = {"correct_first": 0.333, "format": 1.0, "reward": 0.444}
    check = {
        "tuples": 24,
        "blank_change": blank_change(base, trained),
        "ceiling_test": ceiling_test(base, trained),
        "base": {"ranking": ranking, "looks": looking_report(base)},
        "trained": {"ranking": {**ranking, "correct_first": 1.0, "reward": 0.9}, "looks": looking_report(trained)},
    }
    (tmp_path / "held_out.json").write_text(json.dumps(check))
    lines = run_summary(tmp_path, 60.0)
    assert lines[2] == (
        "  held-out check (24 independent tuples held out by content, letters balanced, greedy; base judge -> this "
        "run): correct first 33% -> 100%, format 100% -> 100%, reward 0.444 -> 0.900"
    )
    assert lines[3] == (
        "    color (12): correct first 33% -> 100%; image-following 0% -> 100% [76%, 100%] (null 25%); perception error "
        "first, original -> swapped image 0% -> 100% (paired swap test p 0.00049)"
    )
    assert lines[4] == (
        "      against the base judge forced by the image (image-following 100%, correct first 100%): 0 items only this "
        "run follows, 0 only the forced base judge (McNemar p 1)"
    )
    assert lines[5] == '      blank image: correct first 33% -> 33% (forced base judge 100%); "by the image" 0% -> 100%'
    assert lines[6].startswith("    size (12): ")
    assert lines[9] == (
        "    blank image, this run - the forced base judge: correct first -67% [-83%, -50%] (no text shortcut shown); "
        "image-following's null: 25%, a judge that drops the self-contradicting answer and guesses per image"
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    assert run_summary(bare, 3) == [f"pjray: run finished in 3s: {bare}"]


def test_stack_notices_are_dropped_unless_verbose(monkeypatch, caplog):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    monkeypatch.setattr(auth, "filters", [])
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")
    monkeypatch.delenv("RAY_COLOR_PREFIX")  # restored to what it was after the test
    monkeypatch.delenv(NO_PROGRESS_BARS_ENV, raising=False)
    quiet_stack()
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # the captured stderr is no terminal
    assert os.environ[NO_PROGRESS_BARS_ENV] == "1" and actor_env()[NO_PROGRESS_BARS_ENV] == "1"
    with caplog.at_level(logging.WARNING):
        auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Token authentication is disabled for thi"]
    assert actor_env()["PYTHONWARNINGS"] == ACTOR_WARNING_FILTERS
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert "PYTHONWARNINGS" not in actor_env()
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    monkeypatch.delenv(VERBOSE_ENV)
    assert actor_env()["PYTHONWARNINGS"] == "default"  # the user's own setting wins


def test_set_up_phases_of_a_second_or_more_are_logged(monkeypatch, caplog):
    ticks = iter([0.0, 0.3, 2.5, 2.9])
    monkeypatch.setattr("pjray.console.time.perf_counter", lambda: next(ticks))
    clock = PhaseClock(logging.getLogger("test"))
    with caplog.at_level(logging.INFO):
        clock.done("data")  # 0.3 s: quiet
        clock.done("learners")  # 2.2 s
        clock.done("workers")  # 0.4 s: quiet
    assert [r.getMessage() for r in caplog.records] == ["set-up: learners 2.2s"]


def test_ray_data_info_lines_stay_off_the_console_unless_verbose(monkeypatch):
    import ray.data

    context = ray.data.DataContext.get_current()
    consoles = [
        h
        for h in logging.getLogger("ray.data").handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    assert consoles  # Ray Data's own console handler, set up on import
    for handler in consoles:
        monkeypatch.setattr(handler, "level", logging.INFO)
    monkeypatch.setattr(context, "enable_progress_bars", True)
    monkeypatch.setenv(VERBOSE_ENV, "1")
    quiet_ray_data()
    assert context.enable_progress_bars and all(h.level == logging.INFO for h in consoles)
    progress = logging.getLogger("ray.data._internal.progress")
    monkeypatch.setattr(progress, "filters", [])
    notice = progress.makeRecord(
        progress.name, logging.WARNING, __file__, 0, "Progress bars disabled. To enable, ...", (), None
    )
    assert progress.filter(notice)
    monkeypatch.delenv(VERBOSE_ENV)
    quiet_ray_data()
    quiet_ray_data()
    assert not context.enable_progress_bars and all(h.level == logging.WARNING for h in consoles)
    assert not progress.filter(notice) and len(progress.filters) == 1  # its notice dropped, once


def test_a_local_cluster_starts_without_the_dashboard_unless_asked(monkeypatch):
    """The dashboard is ~2 s of every local start; a cluster joined by address keeps its own."""
    import ray

    from pjray.cluster import connect
    from pjray.config import RayConfig

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect(RayConfig())
    connect(RayConfig(dashboard=True, num_cpus=2))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    connect(RayConfig(dashboard=True))
    assert [c.get("include_dashboard") for c in calls] == [False, True, None]
    assert calls[1]["num_cpus"] == 2 and calls[2]["address"] == "127.0.0.1:6379" and "num_cpus" not in calls[2]
