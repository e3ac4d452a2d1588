"""Where responsibilities live: one module connects to Ray, the driver does not import the
evaluation, the models do not import the trainer, the learner file holds no weight transport, one
chunking helper, one EOS constant."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pjray.placement import shared_threads, split_evenly

PACKAGE = Path(__file__).parents[2] / "pjray"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_only_the_cluster_module_connects_to_ray():
    callers = [name for name, text in _sources().items() if re.search(r"\bray\.init\(", text)]
    assert callers == ["pjray/cluster.py"]


def test_the_driver_does_not_import_the_evaluation():
    """The trainer receives its evaluation hook (pjray.eval.bias.training_eval from the CLI):
    importing the driver loads no pjray.eval module, so no cycle trainer -> eval -> trainer."""
    code = "import sys, pjray.rl.trainer; print(sorted(m for m in sys.modules if m.startswith('pjray.eval')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert not re.search(r"^\s*(from|import) pjray\.eval", (PACKAGE / "rl" / "trainer.py").read_text(), re.M)


def test_a_reward_worker_does_not_import_torch():
    """A reward worker scores text: it starts without torch (seconds of a core at every start,
    beside the learner's own imports), so the typed messages import torch for annotations only."""
    code = "import sys, pjray.reward.workers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_models_do_not_run_the_trainer():
    """A recipe that runs training (pjray.recipes) sits above the models and the trainer: no
    module of pjray.models imports pjray.rl, so no cycle models -> sft -> models."""
    importers = [name for name, text in _sources().items()
                 if name.startswith("pjray/models/") and re.search(r"^\s*(from|import) pjray\.(rl|recipes)\b", text, re.M)]
    assert importers == []


def test_weight_transports_live_beside_sync():
    from pjray.rl.learner import LearnerRank
    from pjray.sync.sender import WeightSender

    transports = ("export_weights", "sync_address", "init_weight_sync", "weight_plan", "broadcast_weights",
                  "stream_ipc", "checksums", "_full_buckets")  # fmt: skip
    for name in transports:
        assert getattr(LearnerRank, name) is getattr(WeightSender, name), name
    learner_source = inspect.getsource(sys.modules["pjray.rl.learner"])
    assert not [name for name in transports if f"def {name}(" in learner_source]


def test_the_rollout_and_sync_packages_stand_below_the_trainer():
    """The rollout side (engines, rollout worker) and weight sync are packages of their own that
    import nothing of the learner, the driver, the evaluation or the recipes (the learner and the
    driver import them), and the placement of actors imports none of the three."""
    upward = r"^\s*(from|import) pjray\.(rl|eval|recipes|sweep|cli)\b"
    importers = [name for name, text in _sources().items()
                 if name.startswith(("pjray/rollout/", "pjray/sync/")) and re.search(upward, text, re.M)]
    assert importers == []
    placement = (PACKAGE / "placement.py").read_text()
    assert not re.search(r"^\s*(from|import) pjray\.(rl|rollout|sync)\b", placement, re.M)
    assert sorted(p.name for p in (PACKAGE / "rl").glob("*.py")) == [
        "__init__.py", "best.py", "checkpoint.py", "ds_ops.py", "ds_setup.py", "grpo.py", "learner.py", "logprobs.py", "sft.py",
        "trainer.py",
    ]


def test_the_trainer_holds_no_branch_on_the_weight_transport():
    """The transport is chosen once (`pjray.sync.transports.make_transport`): no transport name
    is written in the driver, so none can be compared there."""
    trainer = (PACKAGE / "rl" / "trainer.py").read_text()
    assert [name for name in ("shm", "object_store", "gloo", "nccl", "ipc") if f'"{name}"' in trainer] == []
    from pjray.sync.transports import TRANSPORTS

    assert sorted(TRANSPORTS) == ["gloo", "ipc", "nccl", "none", "object_store", "shm"]


def test_one_eos_constant():
    literal = '"<|im_end|>"'
    holders = [name for name, text in _sources().items() if literal in text]
    # prompts.py defines EOS_TOKEN; tiny.py builds the test tokenizer that has the token.
    assert holders == ["pjray/data/prompts.py", "pjray/models/tiny.py"]


def test_one_chunking_helper():
    assert [name for name, text in _sources().items() if "divmod(len(" in text] == ["pjray/placement.py"]


@pytest.mark.parametrize(
    "n, parts, sizes",
    [(10, 3, [4, 3, 3]), (9, 3, [3, 3, 3]), (2, 4, [1, 1]), (0, 2, []), (5, 1, [5])],
)
def test_split_evenly(n, parts, sizes):
    chunks = split_evenly(list(range(n)), parts)
    assert [len(c) for c in chunks] == sizes
    assert [x for c in chunks for x in c] == list(range(n))  # contiguous, in order
    assert split_evenly(range(n), parts) == chunks  # any sequence


@pytest.mark.parametrize(
    "nodes, cpus, threads",
    [
        (["a"], {"a": 2.0}, [2]),  # one actor takes the node's cores
        (["a", "a"], {"a": 2.0}, [1, 1]),
        (["a", "a", "a"], {"a": 2.0}, [1, 1, 1]),  # never fewer than one
        (["a", "a", "b"], {"a": 16.0, "b": 8.0}, [8, 8, 8]),
        (["a", "a"], {"a": 5.0}, [2, 2]),  # rounded down: no oversubscription
    ],
)
def test_shared_threads(nodes, cpus, threads):
    assert shared_threads(nodes, cpus) == threads


def test_split_evenly_rejects_zero_parts():
    with pytest.raises(ValueError, match="parts"):
        split_evenly([1], 0)


def import_graph(root: Path) -> dict[str, set[str]]:
    """pjray module -> the pjray modules it imports, lazy imports inside functions included."""
    import ast

    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pjray"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("pjray")]
            graph[module] |= {r for r in map(resolve, names) if r and r != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_even_through_lazy_imports():
    assert circles(import_graph(PACKAGE)) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
