"""A length-skewed judge batch through the learner's forward and backward, cut three ways:
fixed micro-batches of `--micro` sequences (the order the driver sends them, each padded to its
longest), token-budget micro-batches padded (`learner.micro_batch_tokens`, `packing=false`) and
token-budget micro-batches packed (`packing=true`), the budget being the fixed layout's largest
micro-batch (so no layout's peak is above the fixed one's), and packed under a budget of the
longest sequence (`packed_short`: under SDPA or eager attention a packed micro-batch attends
through an [N, N] block mask, so its attention grows with the square of the packed length; flash
attention's variable-length kernels do not, and need CUDA).

The batch is what a judge's GRPO step holds: images of four sizes (and none), prompts of one to
four paragraphs, responses mostly short with a long tail (`--long` tokens). The judge is the tiny
Qwen2-VL test judge widened to `--hidden` (random weights; fp32 on CPU). Each layout runs the
GRPO loss and its backward over all its micro-batches, `--reps` times interleaved; the table
shows the median seconds, the padding each forwarded, and the largest relative gradient
difference of each layout from the fixed one. The last line is JSON.

    python benchmarks/bench_packing.py [--sequences 32] [--long 1024] [--hidden 256] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = ("fixed", "budgeted", "packed", "packed_short")


def build_judge(out_dir: Path, hidden: int) -> Path:
    """The tiny Qwen2-VL judge with its language model widened to `hidden` (more heads of the
    same size) and 4 layers deep."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from pjray.models.tiny import build_tiny_judge

    path = build_tiny_judge(out_dir, arch="qwen2_vl", seed=0)
    config = AutoConfig.from_pretrained(path)
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads  # M-RoPE's sections are of it: kept
    scale = hidden // text.hidden_size
    text.hidden_size, text.intermediate_size = hidden, text.intermediate_size * scale
    text.num_attention_heads, text.num_key_value_heads = hidden // head_dim, hidden // head_dim // 2
    text.num_hidden_layers, text.layer_types = 4, [text.layer_types[0]] * 4
    config.vision_config.hidden_size = hidden  # the merger projects into the language model's width
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def skewed_batch(n: int, long: int, image_token_id: int, seed: int = 0) -> list:
    """n GRPO experiences of a judge step: 4 samples a prompt, images of four sizes (every
    fifth prompt none), responses of 16-96 tokens with one in six of `long` / 2 to `long`."""
    from PIL import Image

    from pjray.types import Experience

    def png(side: int, index: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (side, side), ((37 * index) % 256, (91 * index) % 256, 128)).save(buf, format="PNG")
        return buf.getvalue()

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = i // 4
        side = (56, 112, 168, 280)[p % 4]
        image = png(side, p) if p % 5 != 4 else None
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>" if image else ""
        user = "Which answer matches the image, A, B or C? " * (1 + 8 * (p % 4))
        prompt = f"<|im_start|>user\n{placeholder}{user}<|im_end|>\n<|im_start|>assistant\n"
        length = rng.randrange(long // 2, long) if rng.random() < 1 / 6 else rng.randrange(16, 96)
        response = tuple(rng.randrange(0, 400) for _ in range(length))
        out.append(Experience(prompt_text=prompt, image=image, response_ids=response, advantage=rng.uniform(-1.5, 1.5)))
    assert image_token_id is not None
    return out


def cuts(layout: str, lengths: list[int], micro: int) -> tuple[list[list[int]], int]:
    """The micro-batches of `layout` (row indices) and the token budget they were cut under."""
    from pjray.rl.microbatch import batch_cost, token_budget_batches

    fixed = [list(range(s, min(s + micro, len(lengths)))) for s in range(0, len(lengths), micro)]
    budget = max(batch_cost([lengths[i] for i in run], packed=False) for run in fixed)
    if layout == "fixed":
        return fixed, budget
    if layout == "packed_short":
        return token_budget_batches(lengths, max(lengths), packed=True), max(lengths)
    return token_budget_batches(lengths, budget, packed=layout == "packed"), budget


def step(
    model, processor, whole, rows: list[list[int]], packed: bool
) -> tuple[float, dict[str, torch.Tensor], int, int]:
    """Forward, GRPO loss and backward over the micro-batches: (seconds, gradients, padding
    positions, positions)."""
    from pjray.rl.grpo import LossSettings, grpo_loss
    from pjray.rl.logprobs import forward_logprobs, forwarded_positions, take_rows

    tokens = float(whole.response_mask.sum())
    seqs = float((whole.response_mask.sum(-1) > 0).sum())
    padding = positions = 0
    model.zero_grad()
    start = time.perf_counter()
    for run in rows:
        batch = take_rows(whole, run)
        logp, _ = forward_logprobs(model, processor, batch, temperature=0.7, shared_prefix=False, packed=packed)
        mask = batch.response_mask[:, 1:]
        loss, _ = grpo_loss(logp, logp.detach(), None, batch.advantages, mask, LossSettings(), tokens, seqs, 1)
        loss.backward()
        pad, pos = forwarded_positions(batch, shared=False, packed=packed)
        padding, positions = padding + pad, positions + pos
    seconds = time.perf_counter() - start
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return seconds, grads, padding, positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8, help="sequences per fixed micro-batch")
    ap.add_argument("--long", type=int, default=1024, help="the long responses' upper length")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 sequences, long tail to 512, one rep")
    args = ap.parse_args()
    if args.quick:
        args.sequences, args.long, args.reps = 16, 512, 1

    from pjray.models.loading import load_judge
    from pjray.rl.logprobs import collate

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load_judge(str(build_judge(Path(tmp) / "judge", args.hidden)), trainable=True)
    whole = collate(processor, skewed_batch(args.sequences, args.long, processor.image_token_id))
    lengths = [int(n) for n in whole.attention_mask.sum(-1)]
    plans = {layout: cuts(layout, lengths, args.micro) for layout in LAYOUTS}
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    padding: dict[str, float] = {}
    for _ in range(args.reps):
        for layout in LAYOUTS:  # interleaved, so load drift hits all alike
            seconds, grads[layout], pad, pos = step(
                model, processor, whole, plans[layout][0], layout.startswith("packed")
            )
            times[layout].append(seconds)
            padding[layout] = pad / pos

    def rel_diff(layout: str) -> float:
        return max(float((grads[layout][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in grads["fixed"].items())

    median = {layout: statistics.median(times[layout]) for layout in LAYOUTS}
    budget = plans["fixed"][1]
    print(
        f"\n{args.sequences} sequences of {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths):,}), "
        f"budget {budget:,} tokens a micro-batch, hidden {args.hidden}, {args.reps} reps, fp32 CPU"
    )
    print(
        f"{'layout':<10} {'micro-batches':>13} {'padding':>8} {'median s':>9} {'range s':>15} {'speed-up':>8} {'grad rel diff':>14}"
    )
    for layout in LAYOUTS:
        print(
            f"{layout:<10} {len(plans[layout][0]):>13} {padding[layout]:>8.1%} {median[layout]:>9.2f} "
            f"{min(times[layout]):>7.2f}-{max(times[layout]):<7.2f} {median['fixed'] / median[layout]:>7.2f}x "
            f"{rel_diff(layout) if layout != 'fixed' else 0.0:>14.1e}"
        )
    print(
        json.dumps(
            {
                "speedup_budgeted": median["fixed"] / median["budgeted"],
                "speedup_packed": median["fixed"] / median["packed"],
                "padding_fixed": padding["fixed"],
                "padding_packed": padding["packed"],
                "speedup_packed_short": median["fixed"] / median["packed_short"],
                "grad_rel_diff": max(rel_diff(layout) for layout in LAYOUTS[1:]),
                "runs": args.reps,
            }
        )
    )


if __name__ == "__main__":
    main()
