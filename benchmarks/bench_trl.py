"""pjray against TRL's `GRPOTrainer`: wall time per GRPO step for the same work, on CPU.

Both train the same random Qwen2-VL judge (pjray.models.tiny: the tiny one, or with `--size 14m` a
~14.7M one where compute weighs more than per-step fixed costs, built once) on the same
judge prompts (scene items from the PPJD job, candidates shuffled and lettered by
pjray.data.prompts), by default as text (data.images=false; chat template and "<think>" prefix
applied by pjray, the same text handed to TRL), with `--images` with each scene's image (TRL
takes the conversation and the PIL image and applies the chat template itself, so neither side
adds the "<think>" prefix; the bench checks that TRL's rendering equals pjray's), with the same reward
(pjray.reward.judge_reward: format x Levenshtein ranking), group size, prompts per step,
response length, sampling (temperature 1, no top-k/top-p), learning rate (constant), clip 0.2,
k3 KL to a reference model at the same coefficient, token-mean loss over the step's batch,
gradient clip 1.0 and one on-policy optimizer step per generation batch. Prints the median step
time over the steps after the first (which pays one-off costs) and the ratio.

What cannot be made identical, and why:
- Process layout: pjray runs its default CPU layout, the hybrid engine: the DeepSpeed (ZeRO-2,
  gloo) learner actor generates with the module it trains (no second copy, no weight sync),
  a reward actor scores, and a driver process drives both over Ray; TRL does all of it in one
  process with one model. That is the comparison being made.
- Threads: each pjray actor sets its torch threads to its node's cores shared by its role's
  actors (here the learner takes both cores, as TRL's process does with torch's default).
- Prompt order: TRL's sampler shuffles the dataset with its own seed, so steps see different
  (equally sized) prompts; rewards are not compared, only time.
- Response lengths differ per sample (both stop at EOS or the length limit), so each row
  reports response tokens per step beside the time.
- pjray's dual clip (c=3) has no TRL counterpart; it is turned off here (algo.dual_clip=0).
- With `--images`, TRL's multimodal path accepts only conversations (not rendered text), so
  the "<think>" prefix, which pjray appends after the chat template, is left out on both sides.

Needs TRL (`pip install 'pjray[bench]'`, or `pip install trl`).

    python benchmarks/bench_trl.py [--steps 5] [--prompts 4] [--group 4] [--max-new 32] [--images] [--size tiny|14m]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray
from PIL import Image

from pjray.cluster import actor_env
from pjray.config import load
from pjray.data.prompts import render_batch
from pjray.models.loading import load_processor, render_chat
from pjray.models.tiny import build_base_judge, build_tiny_judge
from pjray.recipes.training import training_inputs
from pjray.reward import judge_reward
from pjray.rl.items import training_items
from pjray.rl.trainer import Trainer

LR = 1e-4
KL = 0.01


def pjray_overrides(args: argparse.Namespace, model: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={model}",
        f"data.images={str(args.images).lower()}",
        f"model.think_prefix={str(not args.images).lower()}",
        f"data.num_items={args.items}",
        f"trainer.run_dir={run_dir}",
        f"trainer.steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}",
        f"algo.group_size={args.group}",
        f"learner.micro_batch_size={args.prompts * args.group}",
        f"rollout.max_new_tokens={args.max_new}",
        f"learner.lr={LR}",
        f"algo.kl_coef={KL}",
        "algo.dual_clip=0",
        "learner.zero_stage=2",
        "tracking.wandb=false",
        "trainer.export_hf=false",
        "trainer.save_every=0",
        "trainer.resume=disable",
    ]


def run_pjray(args: argparse.Namespace, model: Path, run_dir: Path) -> tuple[list[float], list[float]]:
    cfg = load(overrides=pjray_overrides(args, model, run_dir))
    trainer = Trainer(cfg, training_inputs(cfg))
    times, tokens = [], []
    try:
        trainer.setup()
        for trainer.step in range(1, args.steps + 1):
            metrics = trainer.train_step()
            times.append(metrics["timing_s/step"])
            tokens.append(metrics["perf/total_num_tokens"])
    finally:
        trainer.shutdown()
    return times, tokens


def judge_prompts(args: argparse.Namespace, model: Path, run_dir: Path) -> dict[str, list]:
    """TRL's dataset columns for the prompts pjray's trainer renders for these items: "prompt"
    (the rendered text, or with `--images` the conversation), "target", and "image" (PIL)."""
    cfg = load(overrides=pjray_overrides(args, model, run_dir))
    processor = load_processor(model)
    if args.images:
        from trl.data_utils import prepare_multimodal_messages
    columns: dict[str, list] = {"prompt": [], "target": [], "image": []}
    for index, item in enumerate(training_items(cfg, training_inputs(cfg).items).rows):
        prompt = render_batch(item, random.Random(f"{cfg.trainer.seed}/{index}"), style=cfg.reward.style)
        columns["target"].append(prompt.target)
        if not args.images:
            prompt = dataclasses.replace(prompt, image=None)  # text-only judge, as data.images=false
            columns["prompt"].append(render_chat(processor, prompt, think_prefix=cfg.model.think_prefix))
            continue
        columns["prompt"].append(
            [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}]
        )
        columns["image"].append(Image.open(io.BytesIO(prompt.image)).convert("RGB"))
        trl_text = processor.apply_chat_template(
            prepare_multimodal_messages(columns["prompt"][-1], images=[columns["image"][-1]]),
            add_generation_prompt=True,
            tokenize=False,
        )
        if trl_text != render_chat(processor, prompt, think_prefix=False):
            raise RuntimeError(f"TRL would render item {index} differently from pjray:\n{trl_text!r}")
    if not args.images:
        del columns["image"]
    return columns


def run_trl(
    args: argparse.Namespace, model: Path, columns: dict[str, list], out: Path
) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], target: list[str], **_: object) -> list[float]:
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # conversational: one message
        return [judge_reward(c, t, think_prefilled=not args.images).total for c, t in zip(texts, target)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

    tokens: list[float] = []

    class TokenCount(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * args.prompts * args.group)

    config = GRPOConfig(
        output_dir=str(out),
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group,
        max_completion_length=args.max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # pjray's model.gradient_checkpointing default; TRL turns it on
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForImageTextToText.from_pretrained(model),
        processing_class=load_processor(model) if args.images else AutoTokenizer.from_pretrained(model),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict(columns),
        callbacks=[clock, TokenCount()],
    )
    trainer.train()
    return clock.times, tokens


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new", type=int, default=32, help="response token limit")
    parser.add_argument("--items", type=int, default=32, help="scene items to draw prompts from")
    parser.add_argument("--images", action="store_true", help="prompts with their scene images")
    parser.add_argument(
        "--size",
        choices=("tiny", "14m"),
        default="tiny",
        help="tiny: the 0.2M tiny judge; 14m: a ~14.7M random Qwen2-VL (text 384 wide x 6 layers)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.size == "tiny":
            model = build_tiny_judge(root / "judge", arch="qwen2_vl", seed=0)
        else:
            model = build_base_judge(root / "judge", hidden=384, layers=6, heads=6)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": actor_env()})
        try:
            columns = judge_prompts(args, model, root / "pjray")
            pj_times, pj_tokens = run_pjray(args, model, root / "pjray")
        finally:
            ray.shutdown()
        trl_times, trl_tokens = run_trl(args, model, columns, root / "trl")

    pj, trl = median_after_first(pj_times), median_after_first(trl_times)
    kind = "image prompts" if args.images else "text prompts"
    size = "tiny (0.2M)" if args.size == "tiny" else "~14.7M"
    print(
        f"\nGRPO on CPU, {size} Qwen2-VL judge, {kind}: {args.prompts} prompts x {args.group} responses, "
        f"<= {args.max_new} new tokens, {args.steps} steps; median of steps 2..{args.steps}"
    )
    print("| trainer | s/step | resp tokens/step | all steps (s) |")
    print("|---|---|---|---|")
    print(
        f"| pjray (hybrid engine: Ray actors, DeepSpeed ZeRO-2) | {pj:.3f} | {statistics.median(pj_tokens):.0f} | "
        + ", ".join(f"{t:.2f}" for t in pj_times)
        + " |"
    )
    trl_tok = f"{statistics.median(trl_tokens):.0f}" if trl_tokens else "-"
    print(
        f"| TRL GRPOTrainer (one process) | {trl:.3f} | {trl_tok} | " + ", ".join(f"{t:.2f}" for t in trl_times) + " |"
    )
    print(f"\npjray / TRL step time: {pj / trl:.2f}x")


if __name__ == "__main__":
    main()
