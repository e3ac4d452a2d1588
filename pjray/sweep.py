"""`pjray sweep`: a grid of trainings (e.g. group size x K), one W&B group, a results table and plots.

    pjray sweep --config configs/demo.yaml --grid algo.group_size=2,4,8,16 data.num_candidates=3,4,5

The grid is expanded into trials (the cartesian product of the axes) and every trial's config is
loaded and validated before the first one runs, so a misspelt key or an impossible combination
fails at once, naming the trial and the key. Each trial is an ordinary `pjray train` with
`trainer.run_dir=<sweep_dir>/<trial>` and `tracking.group=<sweep name>`. Trials run one after
another in this process on the connected (or a local) Ray cluster, or, with `--submit ADDRESS`,
as Ray jobs on that cluster, up to `--max-concurrent N` at once (default 1): one loop polls the
jobs in flight and submits the next trial when one ends. Then every run's `metrics.jsonl` is read
back and summarised in `results.json`, `results.md` and PNG plots in the sweep directory.

Concurrent jobs need no resource bookkeeping here: each trial's training reserves its own
placement group (every learner, rollout and reward bundle at once), so a job beyond what the
cluster has free waits for its bundles while the others run, for `ray.placement_timeout_s`
(10 minutes by default; 0 waits as long as it takes): for a queue longer than that, set it to 0
in the grid's fixed overrides, or pick N near the number of trials the cluster holds at once.

A trial's job has the submission id `<sweep name>--<trial>`. A rerun that finds that job (or its
latest resubmission) still pending or running waits for it instead of submitting a duplicate; if
it has ended, the trial is submitted again as `<sweep name>--<trial>--try2`, `--try3`, ...
Ctrl-C stops the jobs in flight before the sweep exits.

A trial that finished is recorded in `<run_dir>/sweep_trial.json` and skipped when the sweep is
run again; an unfinished one resumes from its last checkpoint (trainer.resume=auto). One failed
trial does not stop the others: it is reported as failed, and the command exits non-zero.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import shlex
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, Sequence

from pjray.config import Config, ConfigError, load
from pjray.inputs import check_inputs

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
def run_sweep(
    plan: SweepPlan,
    submit: str = "",
    poll_s: float = 5.0,
    max_concurrent: int = 1,
    client: JobClient | None = None,
) -> list[TrialResult]:
    """Run every unfinished trial, then write the results; returns one result per trial.

    With `submit`, trials are Ray jobs on that job API address, up to `max_concurrent` at once;
    `client` stands in for `ray.job_submission.JobSubmissionClient(submit)`.
    """
    check_concurrency(submit, max_concurrent)
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    (plan.sweep_dir / "sweep.json").write_text(json.dumps(
        {"name": plan.name, "config": plan.config_path, "submit": submit or None,
         "max_concurrent": max_concurrent, "axes": [asdict(a) for a in plan.axes],
         "trials": [{"name": t.name, "params": t.params, "overrides": t.overrides} for t in plan.trials]},
        indent=2,
    ))
    todo = unfinished_trials(plan)
    if submit:
        errors = run_jobs(plan, todo, client or job_client(submit), max_concurrent, poll_s)
    else:
        errors = run_in_process(plan, todo)
    results = collect_results(plan, errors)
    write_results(plan, results)
    return results


def check_concurrency(submit: str, max_concurrent: int) -> None:
    """Concurrent trials must be separate Ray jobs: in-process trials share one driver."""
    if max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {max_concurrent}: at least 1")
    if max_concurrent > 1 and not submit:
        raise ConfigError(
            f"--max-concurrent {max_concurrent} needs --submit ADDRESS: trials run in this process "
            "share one Ray driver, so they run one after another"
        )


def unfinished_trials(plan: SweepPlan) -> list[Trial]:
    """The trials without a finished record, in grid order; the others are logged as skipped."""
    todo = []
    for index, trial in enumerate(plan.trials, start=1):
        if trial_done(Path(trial.config.trainer.run_dir)):
            log.info("sweep %s: trial %d/%d %s already finished", plan.name, index, len(plan.trials), trial.name)
        else:
            todo.append(trial)
    return todo


def trial_done(run_dir: Path) -> bool:
    return (run_dir / TRIAL_RECORD).is_file()


def record_trial(plan: SweepPlan, trial: Trial, wall_s: float, job_id: str = "") -> None:
    """Mark a trial finished, so a rerun of the sweep skips it."""
    run_dir = Path(trial.config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"sweep": plan.name, "trial": trial.name, "params": trial.params,
                              "wall_s": round(wall_s, 3)}
    if job_id:
        record["job"] = job_id
    (run_dir / TRIAL_RECORD).write_text(json.dumps(record))


def run_in_process(plan: SweepPlan, trials: list[Trial]) -> dict[str, str]:
    """Train the trials one after another in this process; returns errors by trial name."""
    from pjray.eval.bias import training_eval
    from pjray.rl.trainer import train

    errors: dict[str, str] = {}
    for index, trial in enumerate(trials, start=1):
        log.info("sweep %s: trial %s (%d of %d to run)", plan.name, trial.name, index, len(trials))
        start = time.perf_counter()
        try:
            train(trial.config, evaluate=training_eval)
        except Exception as err:  # noqa: BLE001 - one failed trial must not stop the sweep
            errors[trial.name] = f"{type(err).__name__}: {err}"
            log.error("sweep %s: trial %s failed:\n%s", plan.name, trial.name, traceback.format_exc())
            continue
        record_trial(plan, trial, time.perf_counter() - start)
    return errors


# --------------------------------------------------------------------------- trials as Ray jobs
class JobClient(Protocol):
    """The part of `ray.job_submission.JobSubmissionClient` the sweep uses."""

    def submit_job(self, *, entrypoint: str, submission_id: str, runtime_env: dict[str, Any] | None) -> str: ...

    def get_job_status(self, job_id: str) -> Any: ...

    def get_job_logs(self, job_id: str) -> str: ...

    def stop_job(self, job_id: str) -> bool: ...

    def list_jobs(self) -> list[Any]: ...


@dataclass
class TrialJob:
    """A trial's Ray job in flight."""

    trial: Trial
    job_id: str
    start: float  # perf_counter when this sweep submitted or found it


def job_client(address: str) -> JobClient:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def run_jobs(
    plan: SweepPlan, trials: list[Trial], client: JobClient, max_concurrent: int, poll_s: float
) -> dict[str, str]:
    """Keep up to `max_concurrent` trial jobs in flight until all have ended; returns errors by
    trial name. On Ctrl-C the jobs in flight are stopped before the interrupt propagates."""
    attempts = job_attempts(client, plan.name, trials)
    queue = list(trials)
    running: list[TrialJob] = []
    errors: dict[str, str] = {}
    try:
        while queue or running:
            while queue and len(running) < max_concurrent:
                trial = queue.pop(0)
                try:
                    running.append(start_job(client, plan, trial, attempts[trial.name]))
                except Exception as err:  # noqa: BLE001 - one failed trial must not stop the sweep
                    errors[trial.name] = f"{type(err).__name__}: {err}"
                    log.error("sweep %s: trial %s not submitted:\n%s", plan.name, trial.name, traceback.format_exc())
            ended = False
            for job in list(running):
                if finish_job(client, plan, job, errors):
                    running.remove(job)  # at once: a Ctrl-C in the next poll must not stop it
                    ended = True
            if running and not ended:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        stop_jobs(client, running)
        raise
    return errors


def submission_id(sweep: str, trial: str, attempt: int = 1) -> str:
    """`<sweep>--<trial>`, then `--try2`, `--try3`, ... for later submissions of the trial."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in sweep)
    base = f"{safe}--{trial}"
    return base if attempt == 1 else f"{base}--try{attempt}"


def job_attempts(client: JobClient, sweep: str, trials: list[Trial]) -> dict[str, int]:
    """The latest attempt number each trial has on the cluster (0: never submitted)."""
    known = {str(job.submission_id) for job in client.list_jobs() if job.submission_id}
    attempts = {}
    for trial in trials:
        pattern = re.escape(submission_id(sweep, trial.name)) + r"(?:--try(\d+))?"
        found = [re.fullmatch(pattern, job_id) for job_id in known]
        attempts[trial.name] = max((int(m.group(1) or 1) for m in found if m), default=0)
    return attempts


def job_status(client: JobClient, job_id: str) -> str:
    """PENDING | RUNNING | STOPPED | SUCCEEDED | FAILED (Ray's JobStatus without its class)."""
    return str(client.get_job_status(job_id)).rsplit(".", 1)[-1]


def start_job(client: JobClient, plan: SweepPlan, trial: Trial, attempt: int) -> TrialJob:
    """Submit the trial as a Ray job, or wait for its job from an earlier run if still going.

    The config file's folder is shipped as the job's working dir, so `--config` resolves on the
    cluster; every path inside the config (data, run dirs) must be valid there, and the sweep dir
    must be on a filesystem both this machine and the cluster see, for the results to be read.
    """
    if attempt:
        latest = submission_id(plan.name, trial.name, attempt)
        if job_status(client, latest) not in TERMINAL_JOB_STATES:
            log.info("sweep %s: trial %s: Ray job %s is still in flight; waiting for it", plan.name, trial.name, latest)
            return TrialJob(trial, latest, time.perf_counter())
    command = ["pjray", "train"]
    runtime_env: dict[str, Any] = {}
    if plan.config_path:
        command += ["--config", Path(plan.config_path).name]
        runtime_env["working_dir"] = str(Path(plan.config_path).resolve().parent)
    command += trial.overrides
    job_id = client.submit_job(
        entrypoint=shlex.join(command), submission_id=submission_id(plan.name, trial.name, attempt + 1),
        runtime_env=runtime_env or None,
    )
    log.info("sweep %s: trial %s: submitted as Ray job %s", plan.name, trial.name, job_id)
    return TrialJob(trial, job_id, time.perf_counter())


def finish_job(client: JobClient, plan: SweepPlan, job: TrialJob, errors: dict[str, str]) -> bool:
    """Poll one job; when it has ended, record the trial (or its error). True if it ended."""
    name = job.trial.name
    try:
        status = job_status(client, job.job_id)
        if status not in TERMINAL_JOB_STATES:
            return False
        if status != "SUCCEEDED":
            tail = client.get_job_logs(job.job_id)[-2000:]
            raise RuntimeError(f"Ray job {job.job_id} ended {status}:\n{tail}")
    except Exception as err:  # noqa: BLE001 - one failed trial must not stop the sweep
        errors[name] = f"{type(err).__name__}: {err}"
        log.error("sweep %s: trial %s failed: %s", plan.name, name, errors[name])
        return True
    record_trial(plan, job.trial, time.perf_counter() - job.start, job.job_id)
    log.info("sweep %s: trial %s finished", plan.name, name)
    return True


def stop_jobs(client: JobClient, jobs: list[TrialJob]) -> None:
    """Ask Ray to stop each job; one that cannot be stopped is logged and left."""
    for job in jobs:
        try:
            client.stop_job(job.job_id)
            log.warning("stopped Ray job %s (trial %s)", job.job_id, job.trial.name)
        except Exception:  # noqa: BLE001 - the others must still be stopped
            log.exception("could not stop Ray job %s (trial %s)", job.job_id, job.trial.name)


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

    check_concurrency(args.submit, args.max_concurrent)
    plan = plan_sweep(args.config, args.grid, args.overrides, args.name, args.sweep_dir)
    if not args.submit:  # submitted trials read their paths on the cluster, which checks them
        for trial in plan.trials:
            check_inputs(trial.config, "train")
    print(f"pjray: sweep {plan.name}: {len(plan.trials)} trials in {plan.sweep_dir}")
    results = run_sweep(plan, submit=args.submit, max_concurrent=args.max_concurrent)
    print((plan.sweep_dir / "results.md").read_text())
    failed = [r.trial for r in results if r.status != "ok"]
    if failed:
        print(f"pjray: sweep {plan.name}: {len(failed)} trial(s) did not finish: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
