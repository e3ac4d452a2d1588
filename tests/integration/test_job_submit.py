"""`ray job submit -- pjray train`, `-- pjray ppjd` and `-- pjray sweep` against a local Ray cluster, and a
training job on a two-node cluster (two raylets on this machine) whose learner and rollout
workers run on different nodes.

The cluster is started with `ray start --head --block` in its own process session, on free
ports and a private temp dir, and stopped by signalling that session. `ray stop` is not used:
it stops every Ray process of the user on the machine, including clusters this test did not
start. `RAY_AUTH_MODE=disabled` is set for both the cluster and the submit command, because a
token written by an earlier `ray.init()` would otherwise switch the new cluster to token auth.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent  # the environment's `ray` and `pjray` scripts

TRAIN = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "data.num_items=16",
    "data.image_size=64",
    "rollout.max_new_tokens=8",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "algo.group_size=2",
    "learner.micro_batch_size=4",
    "tracking.wandb=false",
]
PPJD = ["ppjd.num_items=8", "ppjd.shard_size=4", "ppjd.image_size=64"]


def test_actor_defaults_yield_to_the_job_runtime_env(monkeypatch):
    """ray.init inside a job refuses a driver env naming a variable the job's env sets."""
    from pjray.cluster import actor_env

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    assert actor_env()["TOKENIZERS_PARALLELISM"] == "false"
    job = {"runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "true"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert "TOKENIZERS_PARALLELISM" not in actor_env()
    assert actor_env()["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
    assert actor_env()["NCCL_CUMEM_ENABLE"] == "0"  # learner and vLLM engines alike


def test_cluster_manifests_parse_and_agree():
    """The shipped cluster files are valid YAML, and the RayJob carries the shared runtime env."""
    import yaml

    clusters = REPO / "clusters"
    runtime_env = yaml.safe_load((clusters / "runtime_env.yaml").read_text())
    assert set(runtime_env) == {"env_vars"}
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())  # Ray wants strings
    raycluster, pvc = yaml.safe_load_all((clusters / "kuberay-raycluster.yaml").read_text())
    assert (raycluster["kind"], pvc["kind"]) == ("RayCluster", "PersistentVolumeClaim")
    rayjob = yaml.safe_load((clusters / "kuberay-rayjob.yaml").read_text())
    assert rayjob["kind"] == "RayJob" and rayjob["spec"]["entrypoint"].startswith("pjray train")
    job_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    assert runtime_env["env_vars"].items() <= job_env.items()
    launcher = yaml.safe_load((clusters / "aws-cluster.yaml").read_text())
    assert launcher["provider"]["type"] == "aws" and launcher["head_node_type"] in launcher["available_node_types"]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are chosen (one probed
    and released at a time, the kernel may hand the same port out twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "disabled"
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    # This test's own address must not leak in from an outer cluster.
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def cluster():
    """A local head node; yields the dashboard (job API) address."""
    with local_cluster() as address:
        yield address


@contextlib.contextmanager
def local_cluster(head_resources: dict[str, float] | None = None, worker_resources: dict[str, float] | None = None):
    """A head node (and, with `worker_resources`, a second node joined to it, 2 CPUs each);
    yields the dashboard (job API) address."""
    # Unix socket paths are limited to ~107 bytes: keep the session dir short.
    temp_dir = tempfile.mkdtemp(prefix="pjr", dir="/tmp")
    dashboard, gcs, client, head_agent, worker_agent = free_ports(5)
    # Every port with a fixed default is chosen here, so a second cluster on the machine
    # (another test run, another user) cannot collide with this one.
    command = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--num-cpus=2",
        "--num-gpus=0",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        "--dashboard-host=127.0.0.1",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={head_agent}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    if head_resources:
        command.append(f"--resources={json.dumps(head_resources)}")
    sessions = []
    logs = []
    try:
        logs.append(open(Path(temp_dir) / "head.log", "w"))
        sessions.append(
            subprocess.Popen(command, env=ray_env(), stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        )
        address = f"http://127.0.0.1:{dashboard}"
        wait_for_jobs_api(address, sessions[0], Path(temp_dir) / "head.log")
        if worker_resources is not None:
            worker = [
                str(BIN / "ray"),
                "start",
                "--block",
                f"--address=127.0.0.1:{gcs}",
                "--num-cpus=2",
                "--num-gpus=0",
                f"--resources={json.dumps(worker_resources)}",
                f"--dashboard-agent-listen-port={worker_agent}",
                # A temp dir of its own, as a second machine has: in a shared one the worker node
                # would delete the job's unpacked working dir (the head's driver's cwd) when its
                # actors end.
                f"--temp-dir={Path(temp_dir) / 'w'}",
                "--disable-usage-stats",
            ]
            logs.append(open(Path(temp_dir) / "worker.log", "w"))
            sessions.append(
                subprocess.Popen(
                    worker, env=ray_env(), stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        yield address
    finally:
        for session in reversed(sessions):
            stop_session(session)
        for log in logs:
            log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_jobs_api(address: str, head: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        probe = subprocess.run(
            [str(BIN / "ray"), "job", "list", "--address", address],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return
        time.sleep(2)
    raise RuntimeError(f"the job API at {address} did not come up:\n{log.read_text()[-3000:]}")


def stop_session(head: subprocess.Popen) -> None:
    """SIGTERM lets `ray start --block` shut its node down; SIGKILL the session's leftovers."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def submit(
    address: str, working_dir: Path, entrypoint: list[str], runtime_env: Path | None = None, timeout: float = 240.0
) -> subprocess.CompletedProcess:
    command = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(working_dir)]
    if runtime_env is not None:
        command += ["--runtime-env", str(runtime_env)]
    result = subprocess.run(
        command + ["--", *entrypoint], env=ray_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"ray job submit failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result


@pytest.fixture
def working_dir(tmp_path):
    """What a user would ship with `--working-dir`: just the configs (pjray is installed)."""
    target = tmp_path / "job"
    shutil.copytree(REPO / "configs", target / "configs")
    return target


@pytest.mark.slow
def test_submit_train_job(cluster, working_dir, tmp_path):
    run_dir = tmp_path / "train_run"
    result = submit(
        cluster,
        working_dir,
        ["pjray", "train", "--config", "configs/demo.yaml", *TRAIN, f"trainer.run_dir={run_dir}"],
        # The shipped runtime env: its variables overlap pjray's actor defaults, which must yield.
        runtime_env=REPO / "clusters" / "runtime_env.yaml",
    )
    assert "succeeded" in result.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").is_file()


@pytest.mark.slow
def test_submit_ppjd_job(cluster, working_dir, tmp_path):
    out = tmp_path / "ppjd_out"
    result = submit(
        cluster,
        working_dir,
        ["pjray", "ppjd", "--config", "configs/ppjd_scenes.yaml", *PPJD, f"ppjd.output_dir={out}"],
    )
    assert "succeeded" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["read"] == 8
    assert manifest["shards"] == {"total": 2, "complete": 2, "written_this_run": 2}
    assert manifest["counts"]["kept"] + manifest["counts"]["rejected"] == 8
    assert sorted(p.name for p in (out / "ppjd").glob("*.parquet")) == ["shard-00000.parquet", "shard-00001.parquet"]


@pytest.mark.slow
def test_a_sweep_job_runs_trials_at_once_on_tune_and_reports_the_one_that_failed(working_dir, tmp_path, monkeypatch):
    """`ray job submit -- pjray sweep` on a two-node cluster (2 CPUs each): Tune starts both
    trials at once, each in a placement group of a driver bundle and its training's bundles, the
    training's actors inside it. One trial's reward raises at step 1: it is reported with its
    error, the other finishes, and the job fails (the sweep exits non-zero)."""
    from ray.util.state import list_actors, list_placement_groups, list_tasks

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for the state API client here
    shutil.copy(
        TESTS_DIR / "learnable_rewards.py", working_dir / "learnable_rewards.py"
    )  # imported by the reward workers
    sweep_dir = tmp_path / "sweep"
    with local_cluster(worker_resources={}) as address:
        command = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            str(working_dir),
            "--",
            "pjray",
            "sweep",
            "--config",
            "configs/demo.yaml",
            "--name",
            "tuned",
            "--sweep-dir",
            str(sweep_dir),
            *TRAIN,
            "trainer.export_hf=false",
            "--grid",
            "reward.function=learnable_rewards:starts_with_space,learnable_rewards:broken",
        ]
        result = subprocess.run(command, env=ray_env(), capture_output=True, text=True, timeout=420)
        out = result.stdout + result.stderr
        learners = list_actors(
            address=address, filters=[("class_name", "=", "LearnerRank")], detail=True, raise_on_missing_output=False
        )
        groups = list_placement_groups(address=address, detail=True, raise_on_missing_output=False)
        learner_tasks = list_tasks(address=address, detail=True, raise_on_missing_output=False, limit=10_000)
        learner_tasks = [t for t in learner_tasks if t.func_or_class_name.startswith("LearnerRank")]
    assert result.returncode != 0, out[-4000:]
    assert "trial function-learnable_rewards_broken failed: RuntimeError: this reward is made to fail" in out, out[
        -4000:
    ]
    results = {r["trial"]: r for r in json.loads((sweep_dir / "results.json").read_text())["results"]}
    ok, failed = results["function-learnable_rewards_starts_with_space"], results["function-learnable_rewards_broken"]
    assert (ok["status"], ok["steps"]) == ("ok", 2)
    assert failed["status"] == "failed" and "made to fail" in failed["error"]
    assert (sweep_dir / "function-learnable_rewards_starts_with_space" / "sweep_trial.json").is_file()
    assert not (sweep_dir / "function-learnable_rewards_broken" / "sweep_trial.json").exists()
    assert (sweep_dir / "tune").is_dir()  # the experiment a rerun restores
    # The trials ran at once: the two learner ranks' lives (from their constructor's start to
    # their last call's end) overlap in time.
    spans = {}
    for task in learner_tasks:
        first, last = spans.get(task.actor_id, (math.inf, -math.inf))
        spans[task.actor_id] = (min(first, task.start_time_ms or math.inf), max(last, task.end_time_ms or -math.inf))
    assert len(spans) == 2, learner_tasks
    assert max(first for first, _ in spans.values()) < min(last for _, last in spans.values()), spans
    # Each trial's placement group held a driver bundle and its training's (learner 0.5 CPU,
    # reward worker 0.25), and each training's learner rank ran inside its trial's group.
    trial_groups = {
        g.placement_group_id: g
        for g in groups
        if [b["unit_resources"] for b in g.bundles] == [{"CPU": 0.1}, {"CPU": 0.5}, {"CPU": 0.25}]
    }
    assert len(trial_groups) == 2, groups
    assert len(learners) == 2 and {a.placement_group_id for a in learners} == set(trial_groups), learners


@pytest.mark.slow
def test_learner_and_rollout_on_two_nodes(working_dir, tmp_path):
    """Two raylets on this machine, each offering its own custom resource; the learner rank asks
    for one and the HF rollout worker for the other (`learner.resources`, `rollout.resources`),
    so they run on different nodes. The placement group spans both, `auto` picks the object
    store (no shared memory across nodes), weights cross between the nodes' object stores every
    step, and the checkpoint and HF export land where the driver reads them."""
    run_dir = tmp_path / "two_nodes"
    with local_cluster(head_resources={"pjray_learner": 1}, worker_resources={"pjray_rollout": 1}) as address:
        result = submit(
            address,
            working_dir,
            [
                "pjray",
                "train",
                "--config",
                "configs/demo.yaml",
                *TRAIN,
                "rollout.backend=hf",
                "learner.resources.pjray_learner=1",
                "rollout.resources.pjray_rollout=1",
                f"trainer.run_dir={run_dir}",
            ],
            timeout=420.0,
        )
    out = result.stdout + result.stderr
    chosen = re.search(
        r"weight sync: (\w+) \(trainer.sync_backend=auto; learner rank 0 on node (\w+), rollout workers on \['(\w+)'\]\)",
        out,
    )
    assert chosen, out[-3000:]
    backend, learner_node, rollout_node = chosen.groups()
    assert backend == "object_store" and learner_node != rollout_node
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert all(json.loads(line)["timing_s/sync"] > 0 for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
