"""Judging for evaluation: RolloutWorkers in a WorkerPool, a per-item output cache, and the
`pjray eval` entry point that runs one benchmark and writes its report.

The judge runs through the same engines as training (the HF engine on CPU, vLLM on GPU), one
sample per prompt. `eval.temperature=0` is greedy, done as top-k 1 so that both engines take it
without a special path. Prompts are spread over `eval.workers` actors in rounds of
`eval.prompts_per_call` prompts per worker; after each round the outputs are appended to
`<output_dir>/cache.jsonl`, keyed by a hash of (system, user text, image bytes, judge
fingerprint, seed, sampling settings), so an interrupted or repeated run judges only what is
missing. A blind pass (`eval.image`, `eval.blind`: pjray.eval.blind) shows other image bytes or
none, so its outputs never share a key with the normal ones. Greedy outputs do not depend on
how prompts are batched; sampled ones do (each engine call seeds its own stream), so a sampled
rerun that mixes cached and new outputs is still reproducible per item, not bit-identical to a
fresh run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pjray.config import Config, ConfigError, RolloutConfig, is_outputs_file
from pjray.types import JudgePrompt

if TYPE_CHECKING:
    from pjray.eval.report import EvalReport
    from pjray.placement import WorkerPool

log = logging.getLogger(__name__)

CACHE_FILE = "cache.jsonl"


# --------------------------------------------------------------------------- cache


def judge_fingerprint(judge: str) -> str:
    """Identifies the judge's weights: for a local directory its config and the size and mtime
    of every weight file (a re-export changes it), for a hub id the id itself."""
    path = Path(judge)
    if not path.is_dir():
        return f"hub:{judge}"
    h = hashlib.sha256(str(path.resolve()).encode())
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt") or f.name == "config.json":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cache_key(prompt: JudgePrompt, fingerprint: str, seed: int, sampling: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps([prompt.system, prompt.user, prompt.prefill, fingerprint, seed, sampling], sort_keys=True).encode()
    )
    h.update(hashlib.sha256(prompt.image).digest() if prompt.image is not None else b"no-image")
    return h.hexdigest()


class OutputCache:
    """An append-only JSONL of judge outputs: {key, item_id, seed, text, finish_reason}."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry
                except (json.JSONDecodeError, KeyError):
                    # A run killed mid-write leaves a partial last line: that output is re-judged.
                    log.warning("%s line %d: unreadable cache entry skipped", path, lineno)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put_many(self, entries: list[dict[str, Any]]) -> None:
        for e in entries:
            self.entries[e["key"]] = e
        if self.path is not None and entries:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(e) + "\n" for e in entries))


# --------------------------------------------------------------------------- judging


def eval_sampling(cfg: Config) -> RolloutConfig:
    """The rollout settings of the eval judge: eval.* sampling on the configured backend (the
    HF engine for a training config's hybrid engine: an evaluation has no learner to share)."""
    e = cfg.eval
    greedy = e.temperature == 0
    return dataclasses.replace(
        cfg.rollout,
        backend="hf" if cfg.rollout.backend == "hybrid" else cfg.rollout.backend,
        num_workers=e.workers,
        num_cpus_per_worker=e.num_cpus_per_worker,
        num_gpus_per_worker=e.num_gpus_per_worker,
        max_new_tokens=e.max_new_tokens,
        temperature=1.0 if greedy else e.temperature,
        top_p=1.0 if greedy else e.top_p,
        top_k=1 if greedy else cfg.rollout.top_k,
    )


class JudgeRunner:
    """A pool of judge actors plus the output cache. `generate(prompts, seed) -> texts`."""

    def __init__(self, cfg: Config, cache_path: Path | None):
        e = cfg.eval
        if not e.judge:
            raise ConfigError("eval.judge: required (an HF directory or hub id; `pjray eval --judge`)")
        if cfg.rollout.backend == "vllm" and e.num_gpus_per_worker <= 0:
            raise ConfigError("eval.num_gpus_per_worker: rollout.backend=vllm needs GPUs (> 0)")
        self.cfg = cfg
        self.rollout_cfg = eval_sampling(cfg)
        self.sampling = {
            k: getattr(self.rollout_cfg, k) for k in ("backend", "max_new_tokens", "temperature", "top_p", "top_k")
        }
        self.sampling["think_prefix"] = cfg.model.think_prefix
        self.fingerprint = judge_fingerprint(e.judge)
        self.cache = OutputCache(cache_path)
        self.cache_hits = 0
        self.judged = 0
        self.pool: WorkerPool | None = None
        self.judge_takes_images: bool | None = None  # read from the judge's processor when first needed

    def start(self) -> WorkerPool:
        """The judge actors, started on the first prompts that miss the cache: the benchmark's
        data is read (and any bad row reported) before Ray starts, and a fully cached rerun
        starts no cluster at all."""
        from pjray.cluster import connect
        from pjray.placement import Placement, RoleResources, WorkerPool
        from pjray.rollout.worker import RolloutWorker

        if self.pool is None:
            cfg, e = self.cfg, self.cfg.eval
            connect(cfg.ray)
            self.placement = Placement(
                {"judge": RoleResources(e.workers, e.num_cpus_per_worker, e.num_gpus_per_worker)},
                strategy=cfg.ray.placement_strategy,
                timeout_s=cfg.ray.placement_timeout_s,
            )
            self.pool = WorkerPool(
                self.placement,
                "judge",
                RolloutWorker,
                lambda i: (e.judge, cfg.model, self.rollout_cfg, i),
                max_retries=2,
            )
        return self.pool

    def generate(self, prompts: list[JudgePrompt], seed: int) -> list[str]:
        """One response text per prompt, from the cache where present."""
        from pjray.rollout.worker import generate_with_pool

        keys = [cache_key(p, self.fingerprint, seed, self.sampling) for p in prompts]
        todo = [i for i, k in enumerate(keys) if self.cache.get(k) is None]
        self.cache_hits += len(prompts) - len(todo)
        if not todo:
            return [self.cache.get(k)["text"] for k in keys]  # type: ignore[index]
        if any(prompts[i].image is not None for i in todo):
            self.check_judge_takes_images()
        pool = self.start()
        round_size = self.cfg.eval.prompts_per_call * len(pool)
        for start in range(0, len(todo), round_size):
            batch = todo[start : start + round_size]
            t0 = time.perf_counter()
            completions = generate_with_pool(pool, [prompts[i] for i in batch], 1, seed + start).value
            self.cache.put_many(
                [
                    {
                        "key": keys[i],
                        "item_id": prompts[i].item_id,
                        "seed": seed,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in zip(batch, completions)
                ]
            )
            self.judged += len(batch)
            log.info(
                "judged %d/%d prompts (%.1fs)", min(start + round_size, len(todo)), len(todo), time.perf_counter() - t0
            )
        return [self.cache.get(k)["text"] for k in keys]  # type: ignore[index]

    def check_judge_takes_images(self) -> None:
        """Before any actor starts: a text-only judge shown an image would fail in every worker
        with a message naming data.images, a training key; the eval key is eval.image."""
        from pjray.models.loading import ModelError, is_text_only, load_processor

        e = self.cfg.eval
        if self.judge_takes_images is None:
            try:
                self.judge_takes_images = not is_text_only(load_processor(e.judge))
            except (ModelError, OSError, ValueError):
                return  # a checkpoint that does not load is reported by the judge actors' loading path

        if not self.judge_takes_images:
            raise ConfigError(
                f"eval.image={e.image}, eval.blind={list(e.blind)}: the judge {e.judge} is text-only and the "
                "prompts carry images; it takes only eval.image=none with eval.blind=[]"
            )

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.placement.shutdown()

    def __enter__(self) -> JudgeRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# --------------------------------------------------------------------------- pjray eval


def validation_hook(cfg: Config) -> Any:
    """The trainer's validation every eval.every_steps steps, by eval.train_bench: the Mode a/b
    rates on scene items, or a preference benchmark's rows (read here, before Ray starts)."""
    if cfg.eval.train_bench == "perceptual_bias":
        from pjray.eval.bias import training_eval

        return training_eval
    if not cfg.eval.every_steps:
        return None
    from pjray.eval.reward_bench import TrainingValidation

    return TrainingValidation(cfg)


def run_eval(cfg: Config) -> dict[str, Path]:
    """Run `cfg.eval.bench` on `cfg.eval.judge` (or score `cfg.eval.outputs`) and write the
    report; returns the written paths. With `eval.compare`, every judge or outputs file named
    there is evaluated on the same rows too, each report in a folder of its own, and
    compare.md / compare.json hold one table of them all with the paired test of every pair."""
    e = cfg.eval
    if not e.compare:
        return _run_one(cfg, Path(e.output_dir))[1]
    contenders = [e.outputs or e.judge, *e.compare]
    reports, paths = [], {}
    for i, name in enumerate(contenders):
        outputs = name if is_outputs_file(name) else ""
        one = dataclasses.replace(
            cfg,
            eval=dataclasses.replace(
                e,
                judge="" if outputs else name,
                outputs=outputs,
                compare=[],
                output_dir=str(Path(e.output_dir) / f"{i}_{Path(name).stem or name}"),
            ),
        )
        report, got = _run_one(one, Path(one.eval.output_dir))
        reports.append(report)
        paths.update({f"{i}_{k}": v for k, v in got.items()})
    from pjray.eval.report import write_comparison

    paths.update(write_comparison(contenders, reports, Path(e.output_dir)))
    return paths


def _run_one(cfg: Config, out: Path) -> tuple[EvalReport, dict[str, Path]]:
    from pjray.config import to_dict
    from pjray.eval.report import log_wandb, write_report

    e = cfg.eval
    out.mkdir(parents=True, exist_ok=True)
    if e.outputs:  # outputs produced elsewhere: scored, nothing generated
        report = evaluate(cfg, None)
        sampling: dict[str, Any] = {}
        fingerprint = ""
    else:
        with JudgeRunner(cfg, out / CACHE_FILE if e.cache else None) as runner:
            report = evaluate(cfg, runner.generate)
            report.cache_hits = runner.cache_hits
        sampling, fingerprint = runner.sampling, runner.fingerprint
    report.settings = {"eval": to_dict(cfg)["eval"], "sampling": sampling, "judge_fingerprint": fingerprint}
    paths = write_report(report, out, plots=e.plots)
    if e.wandb:
        log_wandb(report, cfg.tracking, out, to_dict(cfg))
    return report, paths


_IMAGE_NOTES = {
    "grey": "every image the judge saw was a uniform grey image of its size (RGB 128, PNG)",
    "none": "the judge saw no image (text-only prompts)",
    "mismatched": "every item was shown the image of another item of the benchmark (a seeded derangement)",
}
# Blind, MM-JudgeBias's image-only biases lose what they perturb: their BD / BC then say
# nothing about the judge, and the report says so beside them.
_IMAGE_ONLY_BIASES = "text_dominance, image_misalignment, visual_transformation and texture_insertion"
_MM_JUDGEBIAS_NOTES = {
    "grey": f"; {_IMAGE_ONLY_BIASES} compare grey images that differ at most in size",
    "none": f"; {_IMAGE_ONLY_BIASES} and unnecessary_image compare identical inputs",
}


def _image_note(bench: str, mode: str) -> str:
    return _IMAGE_NOTES[mode] + (_MM_JUDGEBIAS_NOTES[mode] if bench == "mm_judgebias" else "")


def evaluate(cfg: Config, generate: Any):
    """The report of `cfg.eval.bench` with the images as `eval.image` shows them, given a
    `generate(prompts, seed) -> texts` function; each `eval.blind` mode judges everything again
    with eval.image=<mode>, its tables and counts in `report.blind[mode]`. The cache keys on the
    image bytes (`cache_key`), so the passes never share an output."""
    from pjray.eval.report import BlindPass

    e = cfg.eval
    report = evaluate_pass(cfg, generate)
    if e.image != "as_is":
        report.notes.append(f"eval.image={e.image}: {_image_note(e.bench, e.image)}")
    for mode in e.blind:
        blind = evaluate_pass(dataclasses.replace(cfg, eval=dataclasses.replace(e, image=mode)), generate)
        report.blind[mode] = BlindPass(
            blind.tables, blind.outputs, blind.unparsed, blind.unparsed_examples, blind.samples, blind.items
        )
        report.notes.append(f"blind pass [{mode}] (eval.blind): {_image_note(e.bench, mode)}")
        if report.items and blind.items:
            from pjray.eval.metrics import paired_verdicts

            report.paired[f"real vs {mode}"] = paired_verdicts(report.items, blind.items)
    return report


def evaluate_pass(cfg: Config, generate: Any):
    """The report of `cfg.eval.bench` judged once, images shown as `cfg.eval.image`."""
    bench = cfg.eval.bench
    if bench in ("score", "pair", "batch"):
        from pjray.eval.judge_bench import evaluate_bench

        return evaluate_bench(cfg, generate)
    if bench == "perceptual_bias":
        from pjray.eval.bias import evaluate_modes

        return evaluate_modes(cfg, generate)
    if bench == "mm_judgebias":
        from pjray.eval.mm_judgebias import evaluate_bias

        return evaluate_bias(cfg, generate)
    if bench == "looking":
        from pjray.eval.looking import evaluate_looking

        return evaluate_looking(cfg, generate)
    if bench in ("vl_rewardbench", "mm_rewardbench"):
        from pjray.eval.reward_bench import evaluate_preference

        return evaluate_preference(cfg, generate)
    raise ConfigError(f"eval.bench={bench!r}: unknown")
