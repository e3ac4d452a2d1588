"""`pjray sweep`: a grid of trainings (e.g. group size x K), one W&B group, a results table and plots.

    pjray sweep --config configs/demo.yaml --grid algo.group_size=2,4,8,16 data.num_candidates=3,4,5

The grid is expanded into trials (the cartesian product of the axes) and every trial's config is
loaded and validated before the first one runs, so a misspelt key or an impossible combination
fails at once, naming the trial and the key. Each trial is an ordinary `pjray train` with
`trainer.run_dir=<sweep_dir>/<trial>` and `tracking.group=<sweep name>`. Trials run one after
another, in this process on the connected (or a local) Ray cluster, or, with `--submit ADDRESS`,
as Ray jobs on that cluster. Then every run's `metrics.jsonl` is read back and summarised in
`results.json`, `results.md` and PNG plots in the sweep directory.

A trial that finished is recorded in `<run_dir>/sweep_trial.json` and skipped when the sweep is
run again; an unfinished one resumes from its last checkpoint (trainer.resume=auto). One failed
trial does not stop the others: it is reported as failed, and the command exits non-zero.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shlex
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from pjray.config import Config, ConfigError, load

log = logging.getLogger(__name__)

# Keys the sweep sets per trial; a grid or override that sets them would be silently replaced.
RESERVED_KEYS = ("trainer.run_dir", "tracking.group")
TRIAL_RECORD = "sweep_trial.json"
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "STOPPED")


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


# --------------------------------------------------------------------------- running
def run_sweep(plan: SweepPlan, submit: str = "", poll_s: float = 5.0) -> list[TrialResult]:
    """Run every trial in sequence, then write the results; returns one result per trial."""
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    (plan.sweep_dir / "sweep.json").write_text(json.dumps(
        {"name": plan.name, "config": plan.config_path, "submit": submit or None,
         "axes": [asdict(a) for a in plan.axes],
         "trials": [{"name": t.name, "params": t.params, "overrides": t.overrides} for t in plan.trials]},
        indent=2,
    ))
    errors: dict[str, str] = {}
    for index, trial in enumerate(plan.trials, start=1):
        run_dir = Path(trial.config.trainer.run_dir)
        if trial_done(run_dir):
            log.info("sweep %s: trial %d/%d %s already finished", plan.name, index, len(plan.trials), trial.name)
            continue
        log.info("sweep %s: trial %d/%d %s", plan.name, index, len(plan.trials), trial.name)
        start = time.perf_counter()
        try:
            if submit:
                submit_trial(submit, plan.config_path, trial, poll_s)
            else:
                from pjray.rl.trainer import train

                train(trial.config)
        except Exception as err:  # noqa: BLE001 - one failed trial must not stop the sweep
            errors[trial.name] = f"{type(err).__name__}: {err}"
            log.error("sweep %s: trial %s failed:\n%s", plan.name, trial.name, traceback.format_exc())
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / TRIAL_RECORD).write_text(json.dumps(
            {"sweep": plan.name, "trial": trial.name, "params": trial.params,
             "wall_s": round(time.perf_counter() - start, 3)}
        ))
    results = collect_results(plan, errors)
    write_results(plan, results)
    return results


def trial_done(run_dir: Path) -> bool:
    return (run_dir / TRIAL_RECORD).is_file()


def submit_trial(address: str, config_path: str | None, trial: Trial, poll_s: float) -> None:
    """Run one trial as a Ray job on `address` and wait for it.

    The config file's folder is shipped as the job's working dir, so `--config` resolves on the
    cluster; every path inside the config (data, run dirs) must be valid there, and the sweep dir
    must be on a filesystem both this machine and the cluster see, for the results to be read.
    """
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    command = ["pjray", "train"]
    runtime_env: dict[str, Any] = {}
    if config_path:
        command += ["--config", Path(config_path).name]
        runtime_env["working_dir"] = str(Path(config_path).resolve().parent)
    command += trial.overrides
    job_id = client.submit_job(entrypoint=shlex.join(command), runtime_env=runtime_env or None)
    log.info("trial %s: submitted as Ray job %s", trial.name, job_id)
    while (status := str(client.get_job_status(job_id)).rsplit(".", 1)[-1]) not in TERMINAL_JOB_STATES:
        time.sleep(poll_s)
    if status != "SUCCEEDED":
        tail = client.get_job_logs(job_id)[-2000:]
        raise RuntimeError(f"Ray job {job_id} ended {status}:\n{tail}")


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
            results.append(TrialResult(
                trial.name, "failed" if trial.name in errors else "missing", trial.params,
                trial.config.algo.group_size, trial.config.data.num_candidates,
                error=errors.get(trial.name, f"no {path}"),
            ))
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
    paths["json"].write_text(json.dumps(
        {"name": plan.name, "config": plan.config_path, "axes": [asdict(a) for a in plan.axes],
         "results": [asdict(r) for r in results]},
        indent=2,
    ))
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
        parts = [f"K={r.num_candidates}"] + [f"{k.rsplit('.', 1)[-1]}={r.params[k]}" for k in other if k != "data.num_candidates"]
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

    try:
        plan = plan_sweep(args.config, args.grid, args.overrides, args.name, args.sweep_dir)
    except ConfigError as err:
        print(f"pjray: bad config: {err}", file=sys.stderr)
        return 2
    print(f"pjray: sweep {plan.name}: {len(plan.trials)} trials in {plan.sweep_dir}")
    results = run_sweep(plan, submit=args.submit)
    print((plan.sweep_dir / "results.md").read_text())
    failed = [r.trial for r in results if r.status != "ok"]
    if failed:
        print(f"pjray: sweep {plan.name}: {len(failed)} trial(s) did not finish: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
