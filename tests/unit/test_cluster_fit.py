"""The GPU recipes and the cluster files agree: each training recipe states what it needs
(clusters/recipe_hardware.yaml: its GPUs and the memory of each, sized in its header comment)
and the cluster files it is meant for, and each of those files provides it.

What a cluster file provides is read from the file: on AWS from the instance type of each GPU
node type (its GPUs and their memory from recipe_hardware.yaml's table) times the type's
max_workers; on KubeRay from the GPU worker group's `nvidia.com/gpu` limit times its
maxReplicas, and its GPUs' memory from the group's required node affinity on GPU Feature
Discovery's `nvidia.com/gpu.memory` label (MiB). A group that does not select on GPU memory
provides none that can be relied on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pjray.config import load

REPO = Path(__file__).resolve().parents[2]
HARDWARE = yaml.safe_load((REPO / "clusters" / "recipe_hardware.yaml").read_text())
RECIPES: dict[str, dict[str, Any]] = HARDWARE["recipes"]


@dataclass(frozen=True)
class GpuNodes:
    """One kind of GPU node a cluster file can bring up."""

    name: str
    gpus: int  # per node
    gpu_memory_gib: float  # per GPU
    max_nodes: int


def aws_nodes(launcher: dict[str, Any]) -> list[GpuNodes]:
    """The GPU node types of a Ray cluster launcher file for AWS."""
    types = HARDWARE["aws_instance_types"]
    out = []
    for name, node in launcher["available_node_types"].items():
        if node.get("resources", {}).get("GPU") == 0:
            continue  # a CPU node (the head)
        instance = node["node_config"]["InstanceType"]
        assert instance in types, (
            f"{name}: instance type {instance} is not in recipe_hardware.yaml's aws_instance_types"
        )
        spec = types[instance]
        max_nodes = node.get("max_workers", launcher.get("max_workers", 0))
        out.append(GpuNodes(f"{name} ({instance})", spec["gpus"], spec["gpu_memory_gib"], max_nodes))
    return out


def _selected_gpu_memory_gib(pod_spec: dict[str, Any]) -> float:
    """The GPU memory every node the pod may land on has, from a required `Gt` node affinity on
    `nvidia.com/gpu.memory` (MiB) in each of its node selector terms; 0 without one."""
    terms = (
        pod_spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    floors = []
    for term in terms:  # the terms are ORed: each must guarantee the memory
        gt = [
            int(e["values"][0])
            for e in term.get("matchExpressions", [])
            if e["key"] == "nvidia.com/gpu.memory" and e["operator"] == "Gt"
        ]
        floors.append((max(gt) + 1) / 1024 if gt else 0.0)
    return min(floors, default=0.0)


def kuberay_nodes(documents: list[dict[str, Any]]) -> list[GpuNodes]:
    """The GPU worker groups of a KubeRay RayCluster or RayJob."""
    out = []
    for doc in documents:
        if doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        for group in cluster["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            gpus = sum(
                int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in pod["containers"]
            )
            if gpus:
                memory = _selected_gpu_memory_gib(pod)
                out.append(
                    GpuNodes(group["groupName"], gpus, memory, int(group.get("maxReplicas", group.get("replicas", 1))))
                )
    return out


def gpu_nodes(path: str, documents: list[dict[str, Any]] | None = None) -> list[GpuNodes]:
    """What the cluster file at `path` (or `documents`, its parsed content) can bring up."""
    if documents is None:
        documents = list(yaml.safe_load_all((REPO / path).read_text()))
    if documents[0].get("provider", {}).get("type") == "aws":
        return aws_nodes(documents[0])
    return kuberay_nodes(documents)


def shortfalls(need: dict[str, Any], nodes: list[GpuNodes]) -> list[str]:
    """Why `nodes` cannot run a recipe that needs `need` (empty: they can). GPUs of too little
    memory do not count; the rest must add up to the recipe's GPUs."""
    fit = [n for n in nodes if n.gpu_memory_gib >= need["gpu_memory_gib"]]
    out = [f"{n.name}: {n.gpu_memory_gib:g} GiB GPUs < {need['gpu_memory_gib']} GiB" for n in nodes if n not in fit]
    total = sum(n.gpus * n.max_nodes for n in fit)
    if total < need["gpus"]:
        out.append(f"{total} GPUs of >= {need['gpu_memory_gib']} GiB, the recipe needs {need['gpus']}")
    return out


def test_every_gpu_training_recipe_states_what_it_needs() -> None:
    trains_on_gpus = {
        f"configs/{p.name}" for p in sorted((REPO / "configs").glob("*.yaml")) if load(p).learner.num_gpus_per_rank > 0
    }
    assert (
        trains_on_gpus
        == set(RECIPES)
        == {
            "configs/qwen3vl_4b.yaml",
            "configs/flex_judge_7b.yaml",
            "configs/llava_ov_7b.yaml",
            "configs/policy_qwen25vl_7b.yaml",
        }
    )
    for recipe, need in RECIPES.items():
        cfg = load(REPO / recipe)
        assert need["gpus"] == cfg.ray.num_gpus, recipe
        judge = cfg.reward.judge
        used = (
            cfg.learner.num_ranks * cfg.learner.num_gpus_per_rank
            + (0 if cfg.rollout.colocate else cfg.rollout.num_workers * cfg.rollout.num_gpus_per_worker)
            + (judge.num_workers * judge.num_gpus_per_worker if cfg.task.kind == "policy" and not judge.colocate else 0)
        )
        assert used <= need["gpus"], recipe
        assert need["gpu_memory_gib"] > 0 and need["clusters"], recipe


@pytest.mark.parametrize(
    "recipe, cluster", [(r, c) for r, need in RECIPES.items() for c in need["clusters"]], ids=lambda v: Path(v).name
)
def test_each_cluster_file_provides_what_its_recipes_need(recipe: str, cluster: str) -> None:
    nodes = gpu_nodes(cluster)
    assert nodes, f"{cluster} brings up no GPU nodes"
    assert shortfalls(RECIPES[recipe], nodes) == [], (recipe, cluster, nodes)


def test_the_rayjob_runs_the_recipe_it_is_checked_for() -> None:
    rayjob = yaml.safe_load((REPO / "clusters" / "kuberay-rayjob.yaml").read_text())
    config = rayjob["spec"]["entrypoint"].split("--config ")[1].split()[0]
    assert "clusters/kuberay-rayjob.yaml" in RECIPES[f"configs/{Path(config).name}"]["clusters"]


def test_a_cluster_of_40_gb_gpus_or_one_that_selects_no_memory_fails_the_check() -> None:
    """The check can fail: A100 40 GB workers (the AWS file's former p4d.24xlarge), a KubeRay
    group without its GPU-memory affinity, or too few nodes."""
    need = RECIPES["configs/qwen3vl_4b.yaml"]
    launcher = yaml.safe_load((REPO / "clusters" / "aws-cluster.yaml").read_text())
    assert shortfalls(need, gpu_nodes("", [launcher])) == []
    small = copy.deepcopy(launcher)
    for node in small["available_node_types"].values():
        if node["node_config"]["InstanceType"].startswith("p4de"):
            node["node_config"]["InstanceType"] = "p4d.24xlarge"
    assert any("40 GiB GPUs < 56 GiB" in s for s in shortfalls(need, gpu_nodes("", [small])))

    documents = list(yaml.safe_load_all((REPO / "clusters" / "kuberay-raycluster.yaml").read_text()))
    unselected = copy.deepcopy(documents)
    del unselected[0]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["affinity"]
    assert [n.gpu_memory_gib for n in gpu_nodes("", unselected)] == [0.0]
    assert shortfalls(need, gpu_nodes("", unselected))
    four_gpus = copy.deepcopy(documents)
    four_gpus[0]["spec"]["workerGroupSpecs"][0]["maxReplicas"] = 1
    for container in four_gpus[0]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]:
        container["resources"]["limits"]["nvidia.com/gpu"] = "4"
    assert shortfalls(need, gpu_nodes("", four_gpus)) == ["4 GPUs of >= 56 GiB, the recipe needs 8"]
