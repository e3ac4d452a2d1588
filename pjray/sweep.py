"""`pjray sweep`: a grid of trainings (e.g. group size x K) on Ray Tune, one W&B group, a results
table and plots.

    pjray sweep --config configs/demo.yaml --grid algo.group_size=2,4,8,16 data.num_candidates=3,4,5
    ray job submit --working-dir . -- pjray sweep --config configs/demo.yaml --grid trainer.seed=0,1,2

The grid is expanded into trials (the cartesian product of the axes) and every trial's config is
loaded and validated (and its input paths checked) before the first one runs, so a misspelt key or
an impossible combination fails at once, naming the trial and the key. Each trial is an ordinary
`pjray train` with `trainer.run_dir=<sweep_dir>/<trial>` and `tracking.group=<sweep name>`.

Trials are scheduled by Ray Tune on the cluster the command runs in (`ray job submit`,
`ray.address`) or a local one. A trial reserves exactly what its training needs
(`trial_resources`) and its training places its actors in that group instead of creating one, so
Tune's accounting is the truth and as many trials run at once as the cluster holds
(`--max-concurrent N` caps it). One failed trial is reported with its error and does not stop the
others; the command then exits non-zero. Ctrl-C stops the trials; the same command again
restores the experiment from `<sweep_dir>/tune` (`run_sweep`). At the end every run's
`metrics.jsonl` is summarised in `results.json`, `results.md` and PNG plots in the sweep
directory. On a cluster of several nodes the sweep dir must be on a filesystem every node sees
(the trials write their run dirs there).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from pjray.cluster import connect
from pjray.config import Config, ConfigError, load
from pjray.inputs import check_inputs
from pjray.signals import Interrupted

log = logging.getLogger(__name__)

# Keys the sweep sets per trial; a grid or override that sets them would be silently replaced.
RESERVED_KEYS = ("trainer.run_dir", "tracking.group")
TRIAL_RECORD = "sweep_trial.json"
TUNE_DIR = "tune"  # the Tune experiment (its state, for restore) inside the sweep dir
# A trial's driver coordinates; its actors hold the compute (their bundles follow this one).
DRIVER_BUNDLE = {"CPU": 0.1}


@dataclass(frozen=True)
class Axis:
    """One grid dimension: a dotted config key and the values to try, as written."""

    key: str
    values: tuple[str, ...]


@dataclass
class Trial:
    """One training of the sweep."""

    name: str  # directory name under the sweep dir, e.g. "group_size-4__num_candidates-3"
    params: dict[str, str]  # the grid's values for this trial, by dotted key
    overrides: list[str]  # everything passed to `pjray train` after --config
    config: Config = field(repr=False)


@dataclass
class SweepPlan:
    name: str
    sweep_dir: Path
    config_path: str | None
    axes: list[Axis]
    trials: list[Trial]

    def trial_for(self, params: dict[str, Any]) -> Trial:
        """The trial of a Tune config (the grid's values by dotted key)."""
        chosen = {a.key: str(params[a.key]) for a in self.axes}
        for trial in self.trials:
            if trial.params == chosen:
                return trial
        raise KeyError(f"sweep {self.name}: no trial has the values {chosen}")


@dataclass
class TrialResult:
    """One row of results.json / results.md."""

    trial: str
    status: str  # ok | failed | missing
    params: dict[str, str]
    group_size: int
    num_candidates: int
    steps: int = 0
    final_reward: float | None = None
    best_reward: float | None = None
    frac_zero_std_mean: float | None = None
    ranking_mean: float | None = None
    ranking_final: float | None = None
    step_time_s: float | None = None  # median over steps (the first carries warm-up)
    tokens_per_s: float | None = None  # response tokens over summed step time
    error: str = ""
    reward_curve: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- the grid
def split_values(text: str) -> list[str]:
    """Split on commas outside brackets, so list values (`eval.seeds=[0,1],[2]`) survive."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts]


def parse_grid(items: Sequence[str]) -> list[Axis]:
    """`key=v1,v2,...` items -> axes. A single value is a fixed override for every trial."""
    axes: list[Axis] = []
    seen: set[str] = set()
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"grid item {item!r}: expected key=value1,value2,...")
        if key in RESERVED_KEYS:
            raise ConfigError(f"{key}: set by the sweep for each trial; not allowed in the grid")
        if key in seen:
            raise ConfigError(f"{key}: appears twice in the grid")
        values = split_values(raw)
        if any(v == "" for v in values):
            raise ConfigError(f"{key}: empty value in {raw!r}")
        if len(set(values)) != len(values):
            raise ConfigError(f"{key}: repeated value in {raw!r}")
        seen.add(key)
        axes.append(Axis(key, tuple(values)))
    return axes


def trial_name(params: dict[str, str], varying: Sequence[str]) -> str:
    """A directory-safe name from the varying axes' short names and values."""
    if not varying:
        return "single"
    parts = []
    for key in varying:
        value = "".join(c if c.isalnum() or c in ".-" else "_" for c in params[key])
        parts.append(f"{key.rsplit('.', 1)[-1]}-{value}")
    return "__".join(parts)


def plan_sweep(
    config_path: str | None,
    grid: Sequence[str],
    overrides: Sequence[str] = (),
    name: str = "",
    sweep_dir: str | Path | None = None,
) -> SweepPlan:
    """Expand the grid and load every trial's config; raises ConfigError naming the trial and key."""
    for item in overrides:
        if item.partition("=")[0].strip() in RESERVED_KEYS:
            raise ConfigError(f"{item.partition('=')[0]}: set by the sweep for each trial; use --sweep-dir / --name")
    axes = parse_grid(grid)
    if not axes:
        raise ConfigError("--grid: at least one key=value1,value2,... item")
    if not name:
        stem = Path(config_path).stem if config_path else "defaults"
        name = f"sweep-{stem}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    root = Path(sweep_dir) if sweep_dir else Path("runs") / "sweeps" / name
    root = root.resolve()  # jobs on other nodes must get one unambiguous path
    varying = [a.key for a in axes if len(a.values) > 1]

    trials: list[Trial] = []
    for values in itertools.product(*(a.values for a in axes)):
        params = {a.key: v for a, v in zip(axes, values)}
        tname = trial_name(params, varying)
        trial_overrides = [
            *overrides,
            *(f"{k}={v}" for k, v in params.items()),
            f"trainer.run_dir={root / tname}",
            f"tracking.group={name}",
        ]
        try:
            cfg = load(config_path, trial_overrides)
        except ConfigError as err:
            raise ConfigError(f"trial {tname}: {err}") from None
        trials.append(Trial(tname, params, trial_overrides, cfg))
    return SweepPlan(name, root, config_path, axes, trials)


# --------------------------------------------------------------------------- running on Ray Tune
def param_space(plan: SweepPlan) -> dict[str, Any]:
    """Tune's search space: a `grid_search` per varying axis, fixed axes as plain values."""
    from ray import tune

    return {a.key: tune.grid_search(list(a.values)) if len(a.values) > 1 else a.values[0] for a in plan.axes}


def trial_resources(cfg: Config) -> Any:
    """What one trial reserves (a `PlacementGroupFactory`): bundle 0 for the trial's driver (Tune
    starts the trial in it), then exactly the bundles its training places its actors in: its
    learner ranks, rollout workers and reward workers (`pjray.placement`)."""
    from ray import tune

    from pjray.placement import placement_plan
    from pjray.rl.layout import choose_layout

    bundles, _ = placement_plan(choose_layout(cfg).roles(), first=1)
    return tune.PlacementGroupFactory([dict(DRIVER_BUNDLE), *bundles], strategy=cfg.ray.placement_strategy)


def run_trial(params: dict[str, Any], plan: SweepPlan) -> None:
    """One trial, inside the Ray actor Tune started it in: an ordinary training (`pjray train`:
    run dir, checkpoints, metrics, HF export, held-out check) whose actors go into the trial's
    placement group; every step's metrics are reported to Tune, the held-out numbers last."""
    import ray
    from ray import tune

    from pjray.console import quiet_stack
    from pjray.eval.runner import validation_hook
    from pjray.recipes.base_judge import held_out_hook
    from pjray.recipes.training import training_inputs
    from pjray.rl.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_stack()
    trial = plan.trial_for(params)
    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError(
            f"trial {trial.name}: not started in a placement group (run it through pjray.sweep.run_sweep)"
        )
    start = time.perf_counter()

    def report(step: int, metrics: dict[str, float]) -> None:
        tune.report({**metrics, "step": step})

    inputs = training_inputs(trial.config)
    run_dir = train(
        trial.config,
        inputs,
        evaluate=validation_hook(trial.config),
        held_out=held_out_hook(trial.config),
        placement_group=group,
        first_bundle=1,
        on_step=report,
    )
    record_trial(plan, trial, time.perf_counter() - start)
    tune.report({"step": trial.config.trainer.steps, "done": 1.0, **held_out_metrics(run_dir)})


def held_out_metrics(run_dir: Path) -> dict[str, float]:
    """held_out/<kind>/<metric> of the trained judge, from the run's held-out check (if it ran)."""
    from pjray.console import HELD_OUT

    path = run_dir / HELD_OUT
    if not path.is_file():
        return {}
    looks = json.loads(path.read_text())["trained"]["looks"]
    return {
        f"held_out/{kind}/{key}": float(numbers[key])
        for kind, numbers in looks.items()
        for key in ("image_following", "correct_first")
    }


def run_sweep(plan: SweepPlan, max_concurrent: int = 0) -> list[TrialResult]:
    """Run every unfinished trial on Ray Tune (the connected cluster, or a local one), then write
    the results; returns one result per trial. As many trials run at once as the cluster holds
    (each reserves its training's placement group), at most `max_concurrent` if > 0.

    Trials run as a `Tuner` over a `grid_search` of the axes. A sweep dir that holds this
    sweep's Tune experiment (`<sweep_dir>/tune`, which Tune saves on Ctrl-C) is restored:
    finished trials are kept, unfinished and failed ones run again (a training resumes from its
    last checkpoint, trainer.resume=auto). A trial that finished writes `sweep_trial.json` into
    its run dir (`record_trial`). Raises `Interrupted` when the sweep was stopped (Ctrl-C)
    before every trial ended."""
    from ray import tune

    if max_concurrent < 0:
        raise ConfigError(f"--max-concurrent {max_concurrent}: 0 (as many as the cluster holds) or more")
    check_same_sweep(plan)
    # Every trial's placement group, sized before anything starts (this imports the trainer, and
    # with it torch, before Ray's threads do).
    resources = {t.name: trial_resources(t.config) for t in plan.trials}
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    (plan.sweep_dir / "sweep.json").write_text(json.dumps(sweep_record(plan), indent=2))
    connect(plan.trials[0].config.ray)
    # Relative paths of a trial's config resolve where the sweep started, not in Tune's trial dir.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, plan=plan), lambda config: resources[plan.trial_for(config).name]
    )
    experiment = plan.sweep_dir / TUNE_DIR
    if tune.Tuner.can_restore(experiment):
        log.info("sweep %s: restoring its Tune experiment %s", plan.name, experiment)
        tuner = tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, restart_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(plan),
            tune_config=tune.TuneConfig(
                max_concurrent_trials=max_concurrent or None,
                trial_name_creator=partial(tune_trial_name, plan),
                trial_dirname_creator=partial(tune_trial_name, plan),
            ),
            run_config=tune.RunConfig(
                name=TUNE_DIR,
                storage_path=str(plan.sweep_dir),
                failure_config=tune.FailureConfig(max_failures=0),
                verbose=1,
            ),
        )
    grid = tuner.fit()
    errors = {plan.trial_for(r.config).name: error_line(r.error) for r in grid if r.error is not None}
    results = collect_results(plan, errors)
    write_results(plan, results)
    unfinished = [
        t.name for t in plan.trials if t.name not in errors and not trial_done(Path(t.config.trainer.run_dir))
    ]
    if unfinished:
        raise Interrupted(
            signal.SIGINT,
            (
                f"sweep {plan.name} stopped with {len(unfinished)} trial(s) unfinished ({', '.join(unfinished)}); "
                "run the same command again to resume it"
            ),
        )
    return results


def tune_trial_name(plan: SweepPlan, trial: Any) -> str:
    """Tune's name (and directory name) of a trial: the sweep's trial name."""
    return plan.trial_for(trial.config).name


def error_line(err: BaseException) -> str:
    """The last line of an error's text: for a trial's failure, the exception its training raised."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def sweep_record(plan: SweepPlan) -> dict[str, Any]:
    return {
        "name": plan.name,
        "config": plan.config_path,
        "axes": [asdict(a) for a in plan.axes],
        "trials": [{"name": t.name, "params": t.params, "overrides": t.overrides} for t in plan.trials],
    }


def check_same_sweep(plan: SweepPlan) -> None:
    """A sweep dir holds one sweep: running another grid (or other overrides) in it would mix
    trials of two experiments, so it is refused."""
    path = plan.sweep_dir / "sweep.json"
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    if recorded.get("trials") != sweep_record(plan)["trials"]:
        raise ConfigError(
            f"{plan.sweep_dir} holds sweep {recorded.get('name')!r} with other trials or overrides; "
            "rerun it as it was, or give this one another --name / --sweep-dir"
        )


def trial_done(run_dir: Path) -> bool:
    return (run_dir / TRIAL_RECORD).is_file()


def record_trial(plan: SweepPlan, trial: Trial, wall_s: float) -> None:
    """Mark a trial finished (written by the trial as its last act)."""
    run_dir = Path(trial.config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"sweep": plan.name, "trial": trial.name, "params": trial.params, "wall_s": round(wall_s, 3)}
    (run_dir / TRIAL_RECORD).write_text(json.dumps(record))


# --------------------------------------------------------------------------- results
def read_metrics(path: Path) -> list[dict[str, float]]:
    """metrics.jsonl rows by step; a resumed run's repeated steps keep their last record."""
    rows: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows[int(record["step"])] = record
    return [rows[s] for s in sorted(rows)]


def summarise(trial: str, params: dict[str, str], cfg: Config, rows: list[dict[str, float]]) -> TrialResult:
    """One table row from a run's per-step metrics."""
    result = TrialResult(trial, "ok", params, cfg.algo.group_size, cfg.data.num_candidates, steps=len(rows))

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in rows if key in r and r[key] is not None and not math.isnan(float(r[key]))]

    rewards = series("reward/mean")
    if rewards:
        result.final_reward, result.best_reward, result.reward_curve = rewards[-1], max(rewards), rewards
    if zero := series("rollout/frac_zero_std"):
        result.frac_zero_std_mean = statistics.fmean(zero)
    if ranking := series("reward/ranking_mean"):
        result.ranking_mean, result.ranking_final = statistics.fmean(ranking), ranking[-1]
    step_times = series("timing_s/step")
    if step_times:
        result.step_time_s = statistics.median(step_times)
        tokens = series("perf/total_num_tokens")
        if tokens and len(tokens) == len(step_times) and sum(step_times) > 0:
            result.tokens_per_s = sum(tokens) / sum(step_times)
    return result


def collect_results(plan: SweepPlan, errors: dict[str, str] | None = None) -> list[TrialResult]:
    errors = errors or {}
    results = []
    for trial in plan.trials:
        path = Path(trial.config.trainer.run_dir) / "metrics.jsonl"
        if trial.name in errors or not path.is_file():
            results.append(
                TrialResult(
                    trial.name,
                    "failed" if trial.name in errors else "missing",
                    trial.params,
                    trial.config.algo.group_size,
                    trial.config.data.num_candidates,
                    error=errors.get(trial.name, f"no {path}"),
                )
            )
            continue
        results.append(summarise(trial.name, trial.params, trial.config, read_metrics(path)))
    return results


COLUMNS = (
    ("final_reward", "final reward", "{:.3f}"),
    ("best_reward", "best reward", "{:.3f}"),
    ("frac_zero_std_mean", "mean frac_zero_std", "{:.2f}"),
    ("ranking_mean", "ranking mean", "{:.3f}"),
    ("step_time_s", "step time (s)", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
)


def results_markdown(plan: SweepPlan, results: list[TrialResult]) -> str:
    """The results table; the grid's other varying keys get their own columns."""
    extra = [a.key for a in plan.axes if len(a.values) > 1 and a.key not in ("algo.group_size", "data.num_candidates")]
    header = ["group size", "K", *extra, "steps", *(title for _, title, _ in COLUMNS), "status"]
    lines = [
        f"# Sweep {plan.name}",
        "",
        f"Config: `{plan.config_path or '(defaults)'}`; grid: "
        + "; ".join(f"`{a.key}` = {', '.join(a.values)}" for a in plan.axes)
        + f". W&B group `{plan.name}`. Step time is the median over steps; tokens/s counts "
        "response tokens over the summed step time; ranking mean is over all steps.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in results:
        cells = [str(r.group_size), str(r.num_candidates), *(r.params.get(k, "") for k in extra), str(r.steps)]
        for key, _, fmt in COLUMNS:
            value = getattr(r, key)
            cells.append("-" if value is None else fmt.format(value))
        # The first line of the error only, without pipes, keeps the table one row per trial.
        first = (r.error.splitlines() or [""])[0][:80].replace("|", "/")
        cells.append(r.status if r.status == "ok" else f"{r.status}: {first}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(plan: SweepPlan, results: list[TrialResult]) -> dict[str, Path]:
    """results.json, results.md and the PNG plots in the sweep directory; returns their paths."""
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": plan.sweep_dir / "results.json", "markdown": plan.sweep_dir / "results.md"}
    paths["json"].write_text(
        json.dumps(
            {
                "name": plan.name,
                "config": plan.config_path,
                "axes": [asdict(a) for a in plan.axes],
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )
    paths["markdown"].write_text(results_markdown(plan, results))
    paths.update(write_plots(plan, results))
    return paths


def write_plots(plan: SweepPlan, results: list[TrialResult]) -> dict[str, Path]:
    """One PNG per metric against group size, a line per K (and any other varying key), plus
    the per-step reward curves."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes or CI
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return {}
    other = [a.key for a in plan.axes if len(a.values) > 1 and a.key != "algo.group_size"]

    def line_label(r: TrialResult) -> str:
        parts = [f"K={r.num_candidates}"] + [
            f"{k.rsplit('.', 1)[-1]}={r.params[k]}" for k in other if k != "data.num_candidates"
        ]
        return ", ".join(parts)

    lines: dict[str, list[TrialResult]] = {}
    for r in ok:
        lines.setdefault(line_label(r), []).append(r)
    paths: dict[str, Path] = {}
    for key, title, _ in COLUMNS:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for label, rows in sorted(lines.items()):
            points = sorted((r.group_size, getattr(r, key)) for r in rows if getattr(r, key) is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("group size n")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs group size")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths[key] = plan.sweep_dir / f"plot_{key}.png"
        fig.savefig(paths[key], dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ok:
        ax.plot(range(1, len(r.reward_curve) + 1), r.reward_curve, label=r.trial)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.set_title("reward per step")
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths["reward_curves"] = plan.sweep_dir / "plot_reward_curves.png"
    fig.savefig(paths["reward_curves"], dpi=100)
    plt.close(fig)
    return paths


# --------------------------------------------------------------------------- command line
def main(args: Any) -> int:
    """`pjray sweep` (argparse namespace from pjray.cli): plan, run, print the table."""
    import sys

    plan = plan_sweep(args.config, args.grid, args.overrides, args.name, args.sweep_dir)
    for trial in plan.trials:
        check_inputs(trial.config, "train")
    print(f"pjray: sweep {plan.name}: {len(plan.trials)} trials in {plan.sweep_dir}")
    results = run_sweep(plan, max_concurrent=args.max_concurrent)
    print((plan.sweep_dir / "results.md").read_text())
    failed = [r for r in results if r.status != "ok"]
    if failed:
        for r in failed:
            print(f"pjray: sweep {plan.name}: trial {r.trial} {r.status}: {r.error}", file=sys.stderr)
        print(
            f"pjray: sweep {plan.name}: {len(failed)} trial(s) did not finish: {', '.join(r.trial for r in failed)}",
            file=sys.stderr,
        )
        return 1
    return 0
