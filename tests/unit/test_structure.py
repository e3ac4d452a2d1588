"""Where responsibilities live: each layer of the package imports only the layers below it, one
module connects to Ray, the driver does not import the evaluation, the learner file holds no
weight transport, one chunking helper, one EOS constant; modules short, their docstrings brief."""

from __future__ import annotations

import ast
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


def test_modules_stay_short_and_their_docstrings_say_why_in_a_few_lines():
    """No module of pjray over 600 lines, and no module docstring over 25: a longer module is
    two jobs, and measured numbers and lab notes belong in benchmarks/results, not docstrings."""
    sources = _sources()
    assert [f"{name}: {text.count(chr(10))} lines" for name, text in sources.items() if text.count("\n") > 600] == []
    long_docs = []
    for name, text in sources.items():
        doc = ast.get_docstring(ast.parse(text), clean=False)
        if doc and doc.count("\n") + 1 > 25:
            long_docs.append(f"{name}: {doc.count(chr(10)) + 1} lines")
    assert long_docs == []


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


def test_weight_transports_live_beside_sync():
    """The learner rank holds its parts as members: each transport is the `WeightSender`'s, and
    the rank's method of that name only hands the call to it."""
    from pjray.rl.learner import LearnerRank
    from pjray.sync.sender import WeightSender

    transports = (
        "export_weights",
        "sync_address",
        "init_weight_sync",
        "weight_plan",
        "broadcast_weights",
        "stream_ipc",
        "checksums",
        "export_adapter",
        "export_shared",
        "close_shared",
    )
    for name in transports:
        assert name in vars(WeightSender), name
        body = inspect.getsource(getattr(LearnerRank, name)).splitlines()[1:]
        assert len(body) == 1 and f"self.weights.{name}(" in body[0], name
    assert "full_buckets" in vars(WeightSender) and not hasattr(LearnerRank, "full_buckets")
    assert [c for c in LearnerRank.__mro__ if c is not object] == [LearnerRank]  # no mixins


def test_the_rollout_and_sync_packages_stand_below_the_trainer():
    """The rollout side (engines, rollout worker) and weight sync are packages of their own that
    import nothing of the learner, the driver, the evaluation or the recipes (the learner and the
    driver import them), and the placement of actors imports none of the three."""
    upward = r"^\s*(from|import) pjray\.(rl|eval|recipes|sweep|cli)\b"
    importers = [
        name
        for name, text in _sources().items()
        if name.startswith(("pjray/rollout/", "pjray/sync/")) and re.search(upward, text, re.M)
    ]
    assert importers == []
    placement = (PACKAGE / "placement.py").read_text()
    assert not re.search(r"^\s*(from|import) pjray\.(rl|rollout|sync)\b", placement, re.M)
    assert sorted(p.name for p in (PACKAGE / "rl").glob("*.py")) == [
        "__init__.py",
        "best.py",
        "checkpoint.py",
        "collect.py",
        "ds_ops.py",
        "ds_setup.py",
        "grpo.py",
        "items.py",
        "layout.py",
        "learner.py",
        "logprobs.py",
        "microbatch.py",
        "policy.py",
        "sft.py",
        "task.py",
        "timer.py",
        "trainer.py",
    ]


def test_the_trainer_holds_no_branch_on_the_weight_transport():
    """The transport is chosen once (`pjray.sync.transports.make_transport`): no transport name
    is written in the driver, so none can be compared there."""
    trainer = (PACKAGE / "rl" / "trainer.py").read_text()
    assert [name for name in ("shm", "object_store", "gloo", "nccl", "ipc") if f'"{name}"' in trainer] == []
    from pjray.sync.transports import TRANSPORTS

    assert sorted(TRANSPORTS) == ["gloo", "ipc", "nccl", "object_store", "shm"]


def test_the_trainer_asks_its_layout_and_only_trains():
    """The layout is chosen once (`pjray.rl.layout.choose_layout`): the trainer names no layout
    and reads none of the keys that decide one; it launches no PPJD job and builds no judge (the
    CLI resolves both, `pjray.recipes.training`); it stays short, its functions shorter."""
    import ast

    source = (PACKAGE / "rl" / "trainer.py").read_text()
    assert [word for word in ("hybrid", "colocate", "backend", "isinstance(self.layout") if word in source] == []
    # Nor does it name the task (`pjray.rl.task.choose_task`): no `if task ==`, no policy branch.
    assert [word for word in ("task.kind", "PolicyTask", "JudgeTask") if word in source] == []
    assert not re.search(r"^\s*(from|import) pjray\.(ppjd|recipes|models\.tiny)\b", source, re.M)
    assert len(source.splitlines()) <= 500  # as ruff formats it
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    assert {f.name: f.end_lineno - f.lineno + 1 for f in functions if f.end_lineno - f.lineno + 1 > 80} == {}


def test_the_data_layer_loads_neither_torch_nor_transformers():
    """Reading and checking rows (images decoded, `pjray.data.images`) starts no model stack."""
    code = (
        "import sys, importlib, pkgutil, pjray.data as d\n"
        "[importlib.import_module(f'pjray.data.{m.name}') for m in pkgutil.iter_modules(d.__path__)]\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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

    modules = {
        ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }

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


# The layers of pjray, lowest first: a module imports modules of its own layer and of the layers
# below, never of a layer above (an upward arrow). A name places a module, or a package with every
# module in it; the longest name that is the module or a package above it decides.
LAYERS = (
    # helpers, and the typed messages that cross actor boundaries (the root holds the version)
    ("pjray", "pjray.types", "pjray.errors", "pjray.signals", "pjray.console", "pjray.memory", "pjray.cache"),
    # the config schema: it defines the scene names it checks values against (pjray.config.data)
    ("pjray.config",),
    # the scene world and its perturbed answers, their shortcuts and swapped images: pure
    # definitions that data, models and evaluation read
    (
        "pjray.data.scenes",
        "pjray.ppjd.perturb",
        "pjray.ppjd.scene_checks",
        "pjray.ppjd.rejects",
        "pjray.ppjd.lexicon",
        "pjray.ppjd.shortcuts",
        "pjray.ppjd.swap",
    ),
    # what reads the config before a job: the inputs it names, experiment tracking
    ("pjray.inputs", "pjray.tracking"),
    # the judge's data: items, prompts, images, samplers (no torch, no transformers)
    ("pjray.data",),
    # its reward and its weights (loading, LoRA, tiny and base judges)
    ("pjray.reward", "pjray.models"),
    # Ray: the one connection to the cluster, where actors are placed, the checkpoint they load
    ("pjray.cluster", "pjray.placement", "pjray.staging"),
    # the rollout side: weight sync, the rollout engines and workers
    ("pjray.sync", "pjray.rollout"),
    # the PPJD job (Ray Data; its LLM rewrites run on the rollout engines)
    ("pjray.ppjd",),
    # training: GRPO math, the learner, SFT, the layout, the driver
    ("pjray.rl",),
    # evaluation: benchmarks and diagnoses on the rollout engines (the driver is handed its hook)
    ("pjray.eval",),
    # recipes: the base judge's build and a training run's inputs, made of training and evaluation
    ("pjray.recipes",),
    # entry points
    ("pjray.sweep", "pjray.cli", "pjray.config_reference", "pjray.__main__"),
)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest name that is `module` or a package above it (the root
    places only itself); None when no name does."""
    index = {name: i for i, names in enumerate(LAYERS) for name in names}
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in index and (name != "pjray" or n == len(parts)):
            return index[name]
    return None


def test_no_module_imports_a_higher_layer():
    graph = import_graph(PACKAGE)
    assert [m for m in sorted(graph) if layer_of(m) is None] == []  # a new package: give it its layer
    assert [
        name for names in LAYERS for name in names if not any(m == name or m.startswith(f"{name}.") for m in graph)
    ] == []
    upward = [
        f"{m} -> {imported}" for m in sorted(graph) for imported in sorted(graph[m]) if layer_of(imported) > layer_of(m)
    ]
    assert upward == []
    assert layer_of("pjray.config") < layer_of("pjray.ppjd.perturb") < layer_of("pjray.ppjd.pipeline")
    assert layer_of("pjray.somewhere_new") is None
