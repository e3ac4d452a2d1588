"""The base judge as an artifact: the copy shipped with pjray, the cache, and the build that runs
the recipe (`pjray.models.base_judge`) through the supervised trainer (`pjray.rl.sft`).

`base_judge(cfg)` is what `pjray train` starts from when no model is given:
1. the **shipped** judge (`pjray/assets/base_judge`), when it was built from the shipped recipe
   (`RECIPES[SHIPPED_INIT]`) and the code on this checkout (its `shipped.json` records the recipe
   hash it was built from);
2. else the judge built earlier into the cache (`<cache>/base_judge/<recipe hash>`);
3. else a build into the cache (25-40 minutes on 2 cores).

`pjray sft` with no model builds into the cache whatever is shipped; `pjray sft --ship` then copies
that build over the shipped one (commit `pjray/assets/base_judge` afterwards). A change to the
recipe or to the code its hash covers, without a re-shipped judge, fails
`tests/unit/test_shipped_base_judge.py`.

The recipe hash follows what decides the weights, by content, not where the code lives: the
recipe's fields, `RECIPE_VERSION`, every byte a build trains on (`build_data`: the tokenizer
corpus, the perception front-end's images and targets, the supervised examples with their
images), and the syntax trees (without docstrings) of the functions that turn that data into
weights (`BUILD_CODE`), wherever they are defined. Moving code, renaming a module or editing a
docstring needs no rebuild; a change to a scene, a prompt or a target does. Changes to what
`BUILD_CODE` calls (the tiny model builders, the SFT loop, the learner's loss, this module's build
settings) bump `RECIPE_VERSION`. Reading the data takes seconds, so its digest is kept per
recipe and state of pjray's code in `<cache>/base_judge/digests`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pjray.cache import atomic_write, cache_root, code_hash
from pjray.data.scenes import generate_scene, render
from pjray.models.base_judge import (
    BaseJudgeRecipe,
    base_config,
    build_untrained,
    object_targets,
    pretrain_vision,
    sft_examples,
    tokenizer_corpus,
    vision_seeds,
)
from pjray.types import JudgeItem

RECIPE_VERSION = 3
# The functions that turn a build's data into weights, hashed by their own code wherever they live.
BUILD_CODE = (base_config, build_untrained, object_targets, pretrain_vision)

# The base judges by `model.init`. base_judge: the judge that knows how to judge by the image and
# mostly does not (its disposition), shipped before one_disposition was. never_shown: the same
# recipe (scenes, perception front-end, probes, the "Image: X." statement, sizes) with every
# supervised verdict by the text (bias 1, no verdict by the image): a judge never shown how to
# look, so that what GRPO teaches it is not a switch it was born with.
# one_disposition: a judge with nothing to switch (every verdict by the image, no disposition
# sentence) whose checks compare each answer with the image's value beside it, built on
# independent tuples, half of its judging examples on the swapped image (the same texts, another
# candidate right); its checks on images of orange and purple are never taught (a random
# candidate marked), so that GRPO has a skill to teach where the base judge guesses. It is the
# shipped one (SHIPPED_INIT): its four gates passed and GRPO taught its untaught part at 5 seeds
# (benchmarks/results/README.md).
RECIPES = {
    "base_judge": BaseJudgeRecipe(),
    "never_shown": BaseJudgeRecipe(bias=1.0, image_verdicts=0.0),
    "one_disposition": BaseJudgeRecipe(
        bias=0.0,
        image_verdicts=1.0,
        disposition=False,
        checks="compare",
        construction="independent",
        untaught=("orange", "purple"),
        batch_examples=3,
        swapped_share=0.5,
    ),
}

SHIPPED_INIT = "one_disposition"  # the recipe whose build pjray ships, and model.init's default
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "base_judge"
SHIPPED_RECORD = "shipped.json"
# What a judge directory holds (the learner's HF export); `report.json` sits beside it.
JUDGE_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)
REBUILD = "rebuild and re-ship it: `pjray sft` (about 25 min on 2 cores), then `pjray sft --ship`, and commit pjray/assets/base_judge"


class ShippedJudgeError(RuntimeError):
    """The shipped base judge is incomplete or not the one its record names."""


def canonical_tree(source: str, imports: bool = True) -> str:
    """The syntax tree of `source` as text, without docstrings and without empty fields (and
    without import statements unless `imports`).

    `ast.dump` is not stable across Python versions: 3.12 added `type_params=[]` to every
    function and class, 3.13 leaves empty fields out. Writing each node's class and its
    non-empty fields alone gives one text for one program on any version pjray supports.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [n for n in body if imports or not isinstance(n, (ast.Import, ast.ImportFrom))]
            kept = kept[1:] if kept and _is_docstring(kept[0]) else kept
            if len(kept) != len(body):
                node.body = kept or [ast.Pass()]
    return _node_text(tree)


def _node_text(value: Any) -> str:
    if isinstance(value, ast.AST):
        fields = [(name, getattr(value, name, None)) for name in value._fields]
        shown = [f"{name}={_node_text(v)}" for name, v in fields if v is not None and v != []]
        return f"{type(value).__name__}({', '.join(shown)})"
    if isinstance(value, list):
        return f"[{', '.join(_node_text(v) for v in value)}]"
    return repr(value)


def _is_docstring(node: Any) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def build_data(recipe: BaseJudgeRecipe) -> Iterator[bytes]:
    """Every byte a build of `recipe` trains on, in order: the tokenizer corpus, the perception
    front-end's scenes (image and targets), and the supervised examples (prompt, image, response)."""
    for line in tokenizer_corpus(recipe):
        yield line.encode()
    for seed in vision_seeds(recipe, recipe.vision_steps * recipe.vision_batch, recipe.vision_split):
        scene = generate_scene(seed, recipe.image_size, 1, 1)
        yield render(scene)
        yield json.dumps(object_targets(scene).tolist()).encode()
    for ex in sft_examples(recipe, recipe.sft_scenes, recipe.seed):
        prompt = {f.name: getattr(ex.prompt, f.name) for f in dataclasses.fields(ex.prompt) if f.name != "image"}
        yield json.dumps(
            {"prompt": prompt, "response": ex.response, "task": ex.task, "untrained": ex.untrained}, default=str
        ).encode()
        yield ex.prompt.image or b""


@functools.lru_cache(maxsize=8)
def data_digest(recipe: BaseJudgeRecipe) -> str:
    """sha256 of `build_data(recipe)`, each piece length-prefixed; kept per recipe and state of
    pjray's code (`code_hash`)."""
    key = hashlib.sha256(json.dumps(recipe.to_dict(), sort_keys=True).encode() + code_hash().encode()).hexdigest()[:16]
    memo = cache_root() / "base_judge" / "digests" / f"{key}.json"
    if memo.exists():
        return json.loads(memo.read_text())["data"]
    digest = hashlib.sha256()
    for piece in build_data(recipe):
        digest.update(len(piece).to_bytes(8, "little") + piece)
    # Written whole: sweep trials look the judge up side by side.
    atomic_write(memo, lambda path: path.write_text(json.dumps({"data": digest.hexdigest()})))
    return digest.hexdigest()


def code_digest(fn: Callable) -> str:
    """A function's syntax tree without docstrings and without its imports (`canonical_tree`),
    hashed: its code, not where it or what it imports lives."""
    return hashlib.sha256(canonical_tree(inspect.getsource(fn), imports=False).encode()).hexdigest()


def recipe_hash(recipe: BaseJudgeRecipe) -> str:
    """Names the cache directory: the recipe's fields, RECIPE_VERSION, the data a build trains on
    and the code of `BUILD_CODE`, each by content."""
    code = sorted(code_digest(fn) for fn in BUILD_CODE)
    payload = {"recipe": recipe.to_dict(), "version": RECIPE_VERSION, "data": data_digest(recipe), "code": code}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_dir(recipe: BaseJudgeRecipe) -> Path:
    """Where a build of `recipe` goes: `hf_model/` (the judge) and `report.json` beside it."""
    return cache_root() / "base_judge" / recipe_hash(recipe)


def weights_sha256(judge: Path) -> str:
    return hashlib.sha256((judge / "model.safetensors").read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the shipped judge


def shipped_record(root: Path | None = None) -> dict[str, Any]:
    """The shipped judge's record (recipe hash, weights digest, build facts); checks that every
    judge file is there and that the weights are the recorded ones."""
    root = root or SHIPPED
    record_path = root / SHIPPED_RECORD
    if not record_path.exists():
        raise ShippedJudgeError(f"no shipped base judge: {record_path} is missing; {REBUILD}")
    record = json.loads(record_path.read_text())
    missing = [f for f in JUDGE_FILES if not (root / "hf_model" / f).exists()]
    if missing or not (root / "report.json").exists():
        raise ShippedJudgeError(f"the shipped base judge lacks {missing or ['report.json']}; {REBUILD}")
    digest = weights_sha256(root / "hf_model")
    if digest != record["weights_sha256"]:
        # A clone without the binary (e.g. a Git LFS pointer) or a hand-edited file.
        raise ShippedJudgeError(
            f"the shipped base judge's weights are not those its record names ({digest[:12]} != "
            f"{record['weights_sha256'][:12]}); {REBUILD}"
        )
    return record


def ship(built: Path, root: Path | None = None) -> dict[str, Any]:
    """Copies a finished build (`<cache>/base_judge/<hash>`) over the shipped judge and writes its
    record; returns the record."""
    root = root or SHIPPED
    if not (built / "hf_model" / "COMPLETE").exists():
        raise ShippedJudgeError(f"{built} holds no finished build")
    report = json.loads((built / "report.json").read_text())
    shutil.rmtree(root, ignore_errors=True)
    (root / "hf_model").mkdir(parents=True)
    for name in JUDGE_FILES:
        shutil.copy2(built / "hf_model" / name, root / "hf_model" / name)
    shutil.copy2(built / "report.json", root / "report.json")
    import torch
    import transformers

    record = {
        "recipe_hash": built.name,
        "weights_sha256": weights_sha256(root / "hf_model"),
        "built_with": {"torch": torch.__version__, "transformers": transformers.__version__},
        "build_seconds": round(report.get("build_seconds", 0.0), 1),
    }
    (root / SHIPPED_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


# --------------------------------------------------------------------------- lookup and build


def base_judge(cfg: Any, recipe: BaseJudgeRecipe | None = None, log: Callable[[str], None] = print) -> Path:
    """The judge of `recipe` (default: the shipped recipe on this checkout): shipped, cached or built."""
    recipe = recipe or RECIPES[SHIPPED_INIT]
    shipped, current = shipped_record()["recipe_hash"], recipe_hash(recipe)
    if shipped == current:
        return SHIPPED / "hf_model"
    target = cache_root() / "base_judge" / current
    if (target / "hf_model" / "COMPLETE").exists():
        return target / "hf_model"
    why = (
        f"the shipped base judge was built from another recipe ({shipped}, this code: {current})"
        if recipe == RECIPES[SHIPPED_INIT]
        else f"no build of recipe {current} in {target.parent}"
    )
    log(f"pjray: {why}; building this one")
    return build_base_judge(cfg, recipe, log=log)


def build_base_judge(
    cfg: Any, recipe: BaseJudgeRecipe, log: Callable[[str], None] = print, report_scenes: int = 64
) -> Path:
    """The base judge of `recipe` built into the cache (reused when a finished build is there):
    perception front-end in this process, then `pjray sft` on the learner, with `report.json`
    (held-out probe and ranking numbers on `report_scenes` scenes) beside it. `cfg` supplies the
    Ray settings of the SFT stage."""
    from pjray.config import SFTConfig
    from pjray.eval.held_out import held_out_report
    from pjray.models.loading import load_judge
    from pjray.rl.sft import run_sft

    target = cached_dir(recipe)
    if (target / "hf_model" / "COMPLETE").exists():
        return target / "hf_model"
    started = time.perf_counter()
    minutes = json.loads((SHIPPED / SHIPPED_RECORD).read_text())["build_seconds"] / 60
    log(
        f"pjray: building the base judge once into {target}: about {minutes:.0f} minutes on 2 CPU cores "
        "(the shipped build's time), then cached"
    )
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    (work / "untrained").mkdir(parents=True)
    build_untrained(str(work / "untrained"), recipe)
    model, processor = load_judge(work / "untrained")
    vision = pretrain_vision(model, processor, recipe, log=log)
    model.save_pretrained(work / "untrained")
    del model
    log(f"pjray: perception front-end trained in {time.perf_counter() - started:.0f}s; held-out cell accuracy {vision}")

    sft_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(work / "untrained"), freeze_vision=True, dtype="float32"),
        sft=SFTConfig(
            source="base_judge",
            num_scenes=recipe.sft_scenes,
            steps=recipe.sft_steps,
            batch_size=recipe.sft_batch,
            lr=recipe.sft_lr,
        ),
        # One rank with two CPUs: Ray then gives its torch two threads, a faster step
        # (benchmarks/results/design_notes.md).
        learner=dataclasses.replace(
            cfg.learner,
            num_ranks=1,
            num_cpus_per_rank=2,
            zero_stage=0,
            bf16=False,
            micro_batch_size=recipe.sft_micro_batch,
        ),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(work / "sft"), seed=recipe.seed),
        tracking=dataclasses.replace(cfg.tracking, wandb=False),  # a cached artefact: metrics.jsonl only
    )
    export = run_sft(sft_cfg, str(work / "untrained"), sft_examples(recipe, recipe.sft_scenes, recipe.seed))
    held_out = held_out_report(str(export), recipe, temperature=cfg.rollout.temperature, n=report_scenes)
    log(f"pjray: base judge on held-out scenes: {json.dumps(held_out)}")
    if not recipe.disposition and recipe.untaught:
        from pjray.eval.held_out import base_judge_gates

        held_out["gates"] = base_judge_gates(str(export), recipe)
        log(f"pjray: the base judge's gates: {json.dumps(held_out['gates']['passes'])}")
    report = {
        "recipe": recipe.to_dict(),
        "vision_cell_accuracy": vision,
        **held_out,
        "build_seconds": time.perf_counter() - started,
    }
    (work / "report.json").write_text(json.dumps(report, indent=2))
    shutil.move(str(export), str(work / "hf_model"))
    (work / "hf_model" / "COMPLETE").touch()
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    log(f"pjray: base judge built in {time.perf_counter() - started:.0f}s: {target / 'hf_model'}")
    return target / "hf_model"


def held_out_hook(cfg: Any) -> Callable[[str, str, Sequence[JudgeItem]], dict[str, Any]] | None:
    """The trainer's held-out hook for a run from a base judge of pjray's recipes (`model.init`),
    as `pjray train` and every sweep trial run it; None for any other judge."""
    from pjray.eval.held_out import held_out_check

    if cfg.model.init not in RECIPES:
        return None
    return functools.partial(held_out_check, recipe=RECIPES[cfg.model.init])
