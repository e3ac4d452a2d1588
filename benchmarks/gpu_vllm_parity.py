"""bf16 parity of vLLM on a GPU against the learner's forward, before and after a weight sync.

    python benchmarks/gpu_vllm_parity.py [--tp 1] [--archs qwen2_vl,qwen3_vl] [--eager] [--max-mean-gap 0.05]

For each tiny judge (untied and tied embeddings) it serves the judge with `VllmEngine` in
bfloat16 on the GPU (sampling with top-k and top-p off: the full distribution), samples a few
answers on images, and compares vLLM's sampled-token log-probs with the learner's teacher-forced
ones (`forward_logprobs`, bf16, same GPU); then it syncs changed weights (every tensor moved; on
a tied judge the embedding alone, so the head must follow) and compares again. Prints one
markdown table (with the vLLM version and whether Model Runner V2 was on, from
`VLLM_USE_V2_MODEL_RUNNER`, and how vLLM compiled the engine), ready to paste into an issue.
`benchmarks/gpu_smoke.sh` runs it with Model Runner V2 off and on, and with tensor parallelism 2
when two GPUs exist.

The engines run as GPU runs take them: compiled, with CUDA graphs (`--eager` for vLLM's eager
mode instead), so a load must reach the tensors the graphs captured. bf16 log-probs of two
different kernels differ by ~1e-2 per token; what this looks for is a gap that is an order of
magnitude larger (a processor, a head, a cache or a graph that did not follow). It exits
non-zero when a mean gap, before or after the sync, exceeds `--max-mean-gap`, or when an engine
meant to run with CUDA graphs runs without them.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image

from pjray.config import load
from pjray.models.loading import load_judge, placeholder_ids, render_chat
from pjray.models.tiny import build_tiny_judge
from pjray.rl.logprobs import collate, forward_logprobs
from pjray.rollout.vllm_engine import VllmEngine
from pjray.sync.buckets import pack, plan_buckets
from pjray.types import Experience, JudgePrompt


def png(rgb: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    image = Image.new("RGB", size, rgb)
    image.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (4, 4, size[0] // 2, size[1] // 2))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PROMPTS = [
    JudgePrompt(
        item_id=str(i),
        system="You are a careful judge.",
        user=user,
        image=png(rgb, size),
        protocol="batch",
        style="ranking",
        num_candidates=3,
        shown=(0, 1, 2),
        target="ABC",
    )
    for i, (user, rgb, size) in enumerate(
        [
            ("Which answer is right? A: red B: blue C: green", (200, 30, 30), (64, 64)),
            ("Rank the three answers by the image.", (30, 60, 200), (640, 480)),
            ("Is the object large? A: yes B: no C: cannot tell", (40, 160, 90), (1920, 1080)),
        ]
    )
]


def learner_logprobs(model, processor, completions) -> list[torch.Tensor]:
    experiences = [
        Experience(
            prompt_text=render_chat(processor, PROMPTS[c.prompt_index]),
            image=PROMPTS[c.prompt_index].image,
            response_ids=c.token_ids,
            advantage=0.0,
        )
        for c in completions
    ]
    batch = collate(processor, experiences)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, processor, batch, torch.device("cuda"), banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:].bool()
    return [logp[i][mask[i]].float().cpu() for i in range(len(completions))]


def gaps(engine: VllmEngine, model, processor) -> tuple[float, float]:
    completions = engine.generate(PROMPTS, n=4, seed=0)
    ours = learner_logprobs(model, processor, completions)
    diffs = torch.cat([(torch.tensor(c.logprobs) - lp).abs() for c, lp in zip(completions, ours)])
    return float(diffs.max()), float(diffs.mean())


def check(arch: str, tied: bool, tp: int, eager: bool, root: Path) -> dict[str, str]:
    path = str(build_tiny_judge(root / f"{arch}-{tied}", arch=arch, seed=0, tied=tied))
    cfg = load(
        overrides=[
            "model.init=tiny",
            f"model.tiny_arch={arch}",
            "model.dtype=bfloat16",
            "rollout.backend=vllm",
            "rollout.device=cuda",
            f"rollout.num_gpus_per_worker={tp}",
            f"rollout.tensor_parallel_size={tp}",
            "rollout.gpu_memory_utilization=0.3",
            "rollout.max_model_len=2048",
            "rollout.max_new_tokens=24",
            "rollout.top_k=0",
            "rollout.top_p=1.0",
            "rollout.temperature=1.0",
            f"rollout.enforce_eager={str(eager).lower()}",
        ]
    )
    engine = VllmEngine(path, cfg.model, cfg.rollout)
    try:
        compilation = engine.compilation()
        model, processor = load_judge(path, dtype="bfloat16", device=torch.device("cuda"), trainable=False)
        before = gaps(engine, model, processor)
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
        noise = torch.Generator(device="cuda").manual_seed(0)
        moved = [k for k in state if (k.endswith("embed_tokens.weight") if tied else True)]
        with torch.no_grad():
            for k in moved:
                state[k] += 0.05 * torch.randn(state[k].shape, generator=noise, device="cuda", dtype=state[k].dtype)
                dict(model.named_parameters())[k].copy_(state[k])
        sent = {k: state[k] for k in moved}
        plan = plan_buckets([(k, v.shape, v.dtype) for k, v in sent.items()], 32 << 20)
        engine.load_weights(plan, [pack(b, sent).cpu() for b in plan])
        after = gaps(engine, model, processor)
    finally:
        engine.close()
    return {
        "arch": arch,
        "tied": str(tied),
        "tp": str(tp),
        "before_max": f"{before[0]:.3g}",
        "before_mean": f"{before[1]:.2g}",
        "after_max": f"{after[0]:.3g}",
        "after_mean": f"{after[1]:.2g}",
        "synced": "embedding" if tied else "every weight",
        "mean_gaps": (before[1], after[1]),
        "cudagraph_mode": compilation["cudagraph_mode"],
        "compile_mode": compilation["mode"],
    }


def failures(rows: list[dict], eager: bool, max_mean_gap: float) -> list[str]:
    """What fails the check: a mean gap over the limit, or CUDA graphs off when they should be on."""
    out = []
    for r in rows:
        name = f"{r['arch']} tied={r['tied']} TP={r['tp']}"
        if max(r["mean_gaps"]) > max_mean_gap:
            out.append(f"{name}: mean |d logprob| {max(r['mean_gaps']):.3g} > {max_mean_gap:g}")
        if not eager and r["cudagraph_mode"] == "NONE":
            out.append(f"{name}: the engine ran without CUDA graphs (compilation {r['compile_mode']})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--archs", default="qwen2_vl,qwen3_vl")
    ap.add_argument("--eager", action="store_true", help="vLLM's eager mode (no torch.compile, no CUDA graphs)")
    ap.add_argument("--max-mean-gap", type=float, default=0.05, help="fail above this mean |d logprob| (bf16: ~1e-2)")
    args = ap.parse_args()
    import vllm

    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "unset")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for arch in args.archs.split(","):
            for tied in (False, True):
                rows.append(check(arch, tied, args.tp, args.eager, Path(root)))
    graphs = sorted({f"{r['compile_mode']}, CUDA graphs {r['cudagraph_mode']}" for r in rows})
    print(
        f"\nvLLM {vllm.__version__}, VLLM_USE_V2_MODEL_RUNNER={runner}, {torch.cuda.get_device_name(0)}, bf16, "
        f"top-k/top-p off, compilation {' / '.join(graphs)}"
    )
    print("| arch | tied | TP | synced | max |d logprob| before | mean before | max after | mean after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arch']} | {r['tied']} | {r['tp']} | {r['synced']} | {r['before_max']} | {r['before_mean']} | "
            f"{r['after_max']} | {r['after_mean']} |"
        )
    failed = failures(rows, args.eager, args.max_mean_gap)
    if failed:
        sys.exit("gpu_vllm_parity: FAIL\n  " + "\n  ".join(failed))
    print("gpu_vllm_parity: PASS")


if __name__ == "__main__":
    main()
