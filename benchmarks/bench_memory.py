"""Peak memory of the learner's log-prob + loss forward and backward: logits projected in chunks
(`forward_logprobs`) against every response position's logits at once (the one-pass path it
replaced, re-implemented below), on the same judge and batch.

The judge is the tiny text-only test judge (`build_tiny_judge(arch="qwen2")`: hidden 64, 2
layers, its 512-token tokenizer) with its vocabulary raised to `--vocab` (65,536 by default) and
random weights, so that the [tokens, V] logits dominate, as they do for a real judge at V = 152k
and long responses. One row: a short prompt and a `--resp-len`-token random response (4,096 by
default), temperature 0.7, the GRPO loss (`grpo_loss`, on-policy) and its backward, the entropy
the learner logs; fp32 on CPU.

Each variant runs in a fresh process, `--reps` times: its peak is that process's ru_maxrss after
the step, less its resident memory just before it (the model and batch already loaded), so
nothing of another variant or of the parent counts. The table shows medians; the variants'
log-probs, entropies and parameter gradients are compared at the end. The last line is JSON.

    python benchmarks/bench_memory.py [--resp-len 4096] [--vocab 65536] [--chunk 1024] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

VARIANTS = ("one-pass", "chunked")
TEMPERATURE = 0.7


def build_judge(out_dir: Path, vocab: int) -> Path:
    """The tiny qwen2 judge with a `vocab`-sized embedding and output projection."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pjray.models.tiny import build_tiny_judge

    path = build_tiny_judge(out_dir, arch="qwen2", seed=0)
    config = AutoConfig.from_pretrained(path)
    config.vocab_size = vocab
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def one_pass(model, processor, batch, temperature: float):
    """The path `forward_logprobs` replaced: the model projects every position from the first
    that predicts a response token, [B, K, V] logits kept for backward; returns (logp [B, T-1],
    entropies of the trained positions [N])."""
    from pjray.rl.grpo import entropy_from_logits, token_logprobs
    from pjray.rl.logprobs import model_inputs

    predicts = batch.response_mask[:, 1:] > 0
    first = int(predicts.any(0).nonzero()[0])
    keep = predicts.shape[1] - first
    out = model(**model_inputs(processor, batch, torch.device("cpu")), use_cache=False, logits_to_keep=keep + 1)
    logits = out.logits[:, :-1]
    logits.div_(temperature)
    kept = token_logprobs(logits, batch.input_ids[:, first + 1 :])
    logp = torch.cat([kept.new_zeros(kept.shape[0], first), kept], dim=1)
    with torch.no_grad():
        entropy = entropy_from_logits(logits.detach()[predicts[:, first:]])
    return logp, entropy


def child(variant: str, judge: str, resp_len: int, chunk: int, out: str) -> None:
    """One measured step in this process; prints a JSON line, saves the numbers to `out`."""
    from pjray.models.loading import load_judge
    from pjray.rl.grpo import LossSettings, grpo_loss
    from pjray.rl.logprobs import collate, forward_logprobs
    from pjray.types import Experience

    model, processor = load_judge(judge, trainable=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (resp_len,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt = "<|im_start|>user\nRank the answers A, B and C.<|im_end|>\n<|im_start|>assistant\n"
    batch = collate(processor, [Experience(prompt_text=prompt, image=None, response_ids=tuple(ids), advantage=1.0)])
    mask = batch.response_mask[:, 1:]
    before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = psutil.Process().memory_info().rss

    start = time.perf_counter()
    if variant == "chunked":
        logp, stats = forward_logprobs(
            model, processor, batch, temperature=TEMPERATURE, shared_prefix=False, chunk_tokens=chunk
        )
        entropy = stats.entropy
    else:
        logp, entropy = one_pass(model, processor, batch, TEMPERATURE)
    loss, _ = grpo_loss(logp, logp.detach(), None, batch.advantages, mask, LossSettings())
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save({"logp": logp.detach()[mask > 0], "entropy": entropy, "grads": grads}, out)
    print(
        json.dumps(
            {
                "peak_mb": (peak - before) / 2**20,
                "rss_peak_mb": peak / 2**20,
                "seconds": seconds,
                "clean": before_peak <= peak,
            }
        )
    )


def run(variant: str, judge: Path, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--judge",
        str(judge),
        "--resp-len",
        str(args.resp_len),
        "--chunk",
        str(args.chunk),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resp-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=1024, help="forward_logprobs(chunk_tokens=...)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run per variant")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--judge", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.judge, args.resp_len, args.chunk, args.out)
        return
    reps = 1 if args.quick else args.reps

    with tempfile.TemporaryDirectory() as tmp:
        judge = build_judge(Path(tmp) / "judge", args.vocab)
        results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for _ in range(reps):
            for variant in VARIANTS:  # interleaved, so load drift hits both alike
                results[variant].append(run(variant, judge, args, Path(tmp) / f"{variant}.pt"))
        saved = {v: torch.load(Path(tmp) / f"{v}.pt") for v in VARIANTS}

    logits_mb = args.resp_len * args.vocab * 4 / 2**20
    print(
        f"\nresponse {args.resp_len} tokens, vocab {args.vocab} (one fp32 [tokens, V] tensor: {logits_mb:,.0f} MB), "
        f"chunk {args.chunk}, {reps} run(s) each, medians\n"
    )
    print("| variant  | step peak above baseline (MB) | process peak RSS (MB) | step seconds |")
    print("|----------|-------------------------------|-----------------------|--------------|")
    med = {}
    for variant in VARIANTS:
        rows = results[variant]
        med[variant] = {k: statistics.median(r[k] for r in rows) for k in ("peak_mb", "rss_peak_mb", "seconds")}
        m = med[variant]
        print(f"| {variant:<8} | {m['peak_mb']:>29,.0f} | {m['rss_peak_mb']:>21,.0f} | {m['seconds']:>12.2f} |")

    a, b = saved["one-pass"], saved["chunked"]
    grad_rel = max(
        float((b["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in a["grads"].items() if g is not None
    )
    summary = {
        "peak_ratio": med["one-pass"]["peak_mb"] / med["chunked"]["peak_mb"],
        "logprob_max_abs_diff": float((a["logp"] - b["logp"]).abs().max()),
        "entropy_max_abs_diff": float((a["entropy"] - b["entropy"]).abs().max()),
        "grad_max_rel_diff": grad_rel,
        "one_pass_peak_mb": med["one-pass"]["peak_mb"],
        "chunked_peak_mb": med["chunked"]["peak_mb"],
        "one_pass_seconds": med["one-pass"]["seconds"],
        "chunked_seconds": med["chunked"]["seconds"],
        "resp_len": args.resp_len,
        "vocab": args.vocab,
        "chunk_tokens": args.chunk,
        "runs": reps,
        "clean_baselines": all(r["clean"] for rows in results.values() for r in rows),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
