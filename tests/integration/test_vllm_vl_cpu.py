"""The vision-language path on vLLM's CPU build, as GPU runs take it: the three tiny Qwen-VL
judges (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) served on images, vLLM's engine core in a process of
its own (its default, and the GPU default), weights synced into it, and GRPO with a trainable
vision tower.

Runs only where vLLM imports (`.venv-vllm`, built by `tests/vllm_cpu_env.sh`; CI runs it with
`-m vllm`). With PJRAY_VLLM_DEVICE=cuda (`benchmarks/gpu_smoke.sh`) the engine checks 1-3 run
on a GPU instead (vLLM's GPU build; the HF reference stays on the CPU). Per architecture:

1. `VllmEngine` samples n answers per image prompt, in order, deterministic in the seed.
2. Its log-probs equal the learner's teacher-forced ones (`forward_logprobs`, the placeholder
   ids banned on both sides) within 1e-4; without the learner's ban they differ by the banned
   placeholders' mass, which is how the two sides drifted apart before.
3. After a sync that changes every weight, vision tower included, the engine's log-probs on
   images it has already encoded equal the updated HF model's: vLLM's encoder cache is reset
   at every load. Both transports that reach a separate engine-core process run: bytes through
   the RPC (the object-store path) and shared memory (only paths cross). A judge with tied
   embeddings (Qwen2-VL, Qwen3-VL) follows a sync of its embedding with its output head.
4. Three GRPO steps with rollout.backend=vllm, images on and the vision tower trainable: the
   rollout's log-probs stay within 1e-3 of the DeepSpeed learner's at every step. On Qwen3-VL
   only (the architecture of the GPU configs' judges): what differs between the three in this
   loop (weight names and layout, M-RoPE, the encoder cache) is checked per architecture by
   1-3, and the loop around the engine does not depend on the architecture. A run costs about
   two minutes on 2 cores.
5. LoRA adapter sync (model.lora.sync=adapter) on image prompts, per architecture: transformers
   names the adapters of a Qwen-VL judge `base_model.model.model.language_model.*`, and vLLM's
   weight-name mapping must place each on its own module; after a sync the engine's log-probs
   on images (teacher-forced and sampled) are the PEFT learner's.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="vllm is not importable here: the vLLM CPU tests run in .venv-vllm "
    "(tests/vllm_cpu_env.sh builds it; CI runs them there with -m vllm)",
)

import ray  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pjray.config import ImageBudget, load  # noqa: E402
from pjray.models.families import family_of  # noqa: E402
from pjray.models.loading import image_token_count, load_judge, load_processor, placeholder_ids, render_chat  # noqa: E402
from pjray.models.lora import apply_lora  # noqa: E402
from pjray.models.tiny import TINY_ARCHS, build_tiny_judge  # noqa: E402
from pjray.models.tiny_families import FAMILY_ARCHS, build_tiny_family_judge  # noqa: E402
from pjray.recipes.training import training_inputs  # noqa: E402
from pjray.rl.logprobs import collate, forward_logprobs  # noqa: E402
from pjray.rl.trainer import Trainer  # noqa: E402
from pjray.rollout.vllm_engine import VllmEngine  # noqa: E402
from pjray.sync.adapter import adapter_update  # noqa: E402
from pjray.sync.buckets import pack, plan_buckets  # noqa: E402
from pjray.sync.shared import SharedBuckets  # noqa: E402
from pjray.types import Experience, JudgePrompt  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning"),
]

MAX_NEW = 12


def _png(rgb: tuple[int, int, int], size: int = 64) -> bytes:
    image = Image.new("RGB", (size, size), rgb)
    image.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (8, 8, size // 2, size // 2))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _prompt(user: str, rgb: tuple[int, int, int]) -> JudgePrompt:
    return JudgePrompt(
        item_id=user[:8],
        system="You are a careful judge.",
        user=user,
        image=_png(rgb),
        protocol="batch",
        style="ranking",
        num_candidates=3,
        shown=(0, 1, 2),
        target="ABC",
    )


PROMPTS = [
    _prompt("Which answer is right? A: red B: blue C: green", (200, 30, 30)),
    _prompt("Rank the three answers by the image.", (30, 60, 200)),
]


DEVICE = os.environ.get("PJRAY_VLLM_DEVICE", "cpu")
ON_DEVICE = (
    ["rollout.device=cpu"]
    if DEVICE == "cpu"
    else ["rollout.device=cuda", "rollout.num_gpus_per_worker=1", "rollout.gpu_memory_utilization=0.3"]
)


# An image budget below the tiny judges' own bound (16 tokens: 12,544 px on Qwen2/2.5-VL, 16,384 on
# Qwen3-VL) and above their lower one, so it binds on large images: ~10 and 8 tokens at most.
BUDGET = 8 * 32 * 32


def _overrides(arch: str) -> list[str]:
    return [
        "model.init=tiny",
        "algo.prefilter_zero_std=false",
        f"model.tiny_arch={arch}",
        "rollout.backend=vllm",
        *ON_DEVICE,
        "rollout.max_model_len=1024",
        f"rollout.max_new_tokens={MAX_NEW}",
        f"model.max_pixels={BUDGET}",
    ]


class Served(NamedTuple):
    arch: str
    path: str
    engine: VllmEngine


@pytest.fixture(scope="module", params=TINY_ARCHS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    path = str(build_tiny_judge(tmp_path_factory.mktemp(arch), arch=arch, seed=0))
    cfg = load(overrides=_overrides(arch))
    engine = VllmEngine(path, cfg.model, cfg.rollout)
    yield Served(arch, path, engine)
    engine.close()


def _learner_logprobs(
    path: str, prompts: list[JudgePrompt], completions, temperature: float, banned: bool
) -> list[torch.Tensor]:
    """The learner's teacher-forced log-probs of each completion (its own forward function), its
    processor under the served engine's image budget."""
    model, processor = load_judge(path, trainable=False, budget=ImageBudget(max_pixels=BUDGET))
    return _sampled_logprobs(model, processor, prompts, completions, temperature, banned)


def _sampled_logprobs(model, processor, prompts, completions, temperature: float, banned: bool) -> list[torch.Tensor]:
    """`model`'s log-probs of each sampled completion after its prompt, at `temperature`, with
    the placeholder ban the engine applies or without it."""
    experiences = [
        Experience(
            prompt_text=render_chat(processor, prompts[c.prompt_index]),
            image=prompts[c.prompt_index].image,
            response_ids=c.token_ids,
            advantage=0.0,
        )
        for c in completions
    ]
    batch = collate(processor, experiences)
    with torch.no_grad():
        logp, _ = forward_logprobs(
            model, processor, batch, temperature=temperature, banned=placeholder_ids(processor) if banned else ()
        )
    mask = batch.response_mask[:, 1:].bool()
    return [logp[i][mask[i]] for i in range(len(completions))]


def _learner_logprobs_on(model, processor, prompts, continuations) -> list[torch.Tensor]:
    """HF log-probs of each continuation after its prompt at temperature 1, nothing banned:
    what vLLM's prompt log-probs (`continuation_logprobs`) are."""
    experiences = [
        Experience(prompt_text=render_chat(processor, p), image=p.image, response_ids=tuple(c), advantage=0.0)
        for p, c in zip(prompts, continuations)
    ]
    batch = collate(processor, experiences)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, processor, batch)
    mask = batch.response_mask[:, 1:].bool()
    return [logp[i][mask[i]] for i in range(len(experiences))]


def _max_gap(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return float((torch.as_tensor(a, dtype=torch.float32) - b.float()).abs().max())


def test_samples_images_in_order_and_in_the_seed(served: Served) -> None:
    engine, n = served.engine, 3
    out = engine.generate(PROMPTS, n=n, seed=7)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(len(PROMPTS)) for s in range(n)]
    for c in out:
        assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
        assert all(-1e9 < lp <= 0 for lp in c.logprobs)
        assert not set(c.token_ids) & set(engine.banned_ids)  # placeholders are never sampled
    assert len({c.token_ids for c in out}) > 1
    assert engine.generate(PROMPTS, n=n, seed=7) == out
    assert engine.generate(PROMPTS, n=n, seed=8) != out


def test_served_logprobs_equal_the_learners(served: Served) -> None:
    """Sampled at T=0.7 on images: vLLM's log-probs are the learner's, with the placeholder ban
    on both sides (1e-4); the learner without the ban is off by the banned mass."""
    saved = served.engine.rollout_cfg
    served.engine.rollout_cfg = dataclasses.replace(saved, temperature=0.7)  # read per request
    try:
        out = served.engine.generate(PROMPTS, n=2, seed=5)
    finally:
        served.engine.rollout_cfg = saved
    banned = _learner_logprobs(served.path, PROMPTS, out, 0.7, banned=True)
    unbanned = _learner_logprobs(served.path, PROMPTS, out, 0.7, banned=False)
    gap = max(_max_gap(c.logprobs, lp) for c, lp in zip(out, banned))
    gap_unbanned = max(_max_gap(c.logprobs, lp) for c, lp in zip(out, unbanned))
    print(
        f"\n{served.arch}: served vs learner max |d logprob| {gap:.2e} (banned both sides), {gap_unbanned:.2e} (learner unbanned)"
    )
    assert gap <= 1e-4, gap
    assert gap_unbanned > 1e-3, gap_unbanned  # the ban matters for a random judge: the check can fail

    # Prompt log-probs on images (raw logits, nothing banned) are the HF model's too.
    model, processor = load_judge(served.path, trainable=False)
    continuation = out[0].token_ids
    served_lp = served.engine.continuation_logprobs(PROMPTS[0], continuation)
    (expected,) = _learner_logprobs_on(model, processor, PROMPTS[:1], [continuation])
    assert _max_gap(served_lp, expected) <= 1e-4


def _rect_png(width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), (40, 160, 90))
    image.paste((220, 220, 30), (width // 4, height // 4, width // 2, height // 2))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_images_of_any_size_reach_vllm_as_they_reach_the_learner(served: Served) -> None:
    """Processor parity under a binding image budget: images of several sizes and aspect ratios
    expand to different grids, every one within the budget, and vLLM's samples' log-probs are the
    learner's (1e-4), which holds only if both sides resized each image to the same grid and
    pixels (another grid shifts every position after the image)."""
    sizes = [(97, 61), (640, 480), (1920, 1080), (3000, 400)]
    prompts = [dataclasses.replace(PROMPTS[0], item_id=f"s{w}x{h}", image=_rect_png(w, h)) for w, h in sizes]
    processor = load_processor(served.path, ImageBudget(max_pixels=BUDGET))
    factor = processor.image_processor.patch_size * processor.image_processor.merge_size
    tokens = [image_token_count(processor, p.image) for p in prompts]
    assert len(set(tokens)) > 1 and max(tokens) <= BUDGET // (factor * factor), tokens
    out = served.engine.generate(prompts, n=1, seed=3)
    learner = _learner_logprobs(served.path, prompts, out, served.engine.rollout_cfg.temperature, banned=True)
    gap = max(_max_gap(c.logprobs, lp) for c, lp in zip(out, learner))
    print(f"\n{served.arch}: image tokens {tokens}; served vs learner max |d logprob| {gap:.2e}")
    assert gap <= 1e-4, gap


def _named(path: str) -> tuple[dict[str, torch.Tensor], object, object]:
    model, processor = load_judge(path, trainable=False)
    return {k: v.detach() for k, v in model.named_parameters()}, model, processor


def test_sync_of_every_weight_resets_the_encoder_cache(served: Served, tmp_path: Path) -> None:
    """Images encoded before a sync are encoded again with the new vision tower: after loading
    another seed's weights (every tensor differs, the vision tower's too) the engine's log-probs
    on the same images equal the new HF model's, then back again through shared memory."""
    engine = served.engine
    continuations = [engine.generate([p], n=1, seed=0)[0].token_ids for p in PROMPTS]
    before = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]  # encoder cache warm

    new, new_model, processor = _named(str(build_tiny_judge(tmp_path / "other", arch=served.arch, seed=1)))
    old, old_model, _ = _named(served.path)
    with torch.no_grad():  # another seed, and what it initialises alike (norms) moved too
        noise = torch.Generator().manual_seed(0)
        for name, value in new.items():
            if torch.equal(value, old[name]):
                value.add_(0.1 * torch.randn(value.shape, generator=noise))
    assert any(k.startswith("model.visual") for k in new) and all(not torch.equal(new[k], old[k]) for k in new)
    plan = plan_buckets([(k, v.shape, v.dtype) for k, v in new.items()], 64 << 10)
    assert len(plan) > 3

    # Object-store path: each bucket crosses into the engine-core process as bytes.
    engine.load_weights(plan, [pack(b, new) for b in plan])
    expected = _learner_logprobs_on(new_model, processor, PROMPTS, continuations)
    after = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
    gaps = [_max_gap(a, e) for a, e in zip(after, expected)]
    moved = [_max_gap(a, torch.tensor(b)) for a, b in zip(after, before)]
    print(f"\n{served.arch}: after the bytes sync, served vs new HF {max(gaps):.2e}; moved {min(moved):.2e}")
    assert max(gaps) <= 1e-4, gaps
    assert min(moved) > 1e-2, moved

    # Shared memory: the engine core maps the learner's buffers; back to the old weights.
    shared = SharedBuckets(tmp_path)
    try:
        plan_old, paths = shared.write(
            (b, old) for b in plan_buckets([(k, v.shape, v.dtype) for k, v in old.items()], 64 << 10)
        )
        engine.load_shared(plan_old, paths)
    finally:
        shared.close()
    expected_old = _learner_logprobs_on(old_model, processor, PROMPTS, continuations)
    back = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
    assert max(_max_gap(a, e) for a, e in zip(back, expected_old)) <= 1e-4


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_judge_of_another_family_is_served_and_synced(arch: str, tmp_path: Path) -> None:
    """LLaVA-OneVision, InternVL, Gemma 3 and Idefics3 judges on vLLM's CPU build: the sampled
    log-probs on images are the learner's, and after a sync of every weight (vision part
    included, under transformers' names: a SigLIP tower's reach vLLM in the released layout) the
    served log-probs are the new HF model's. vLLM's vision encoders sum in another order than
    transformers': 5e-4 (Qwen-VL's hold 1e-4)."""
    path = str(build_tiny_family_judge(tmp_path / arch, arch=arch, seed=0))
    shared = [o for o in _overrides("qwen2_vl") if not o.startswith(("model.init", "model.tiny_arch"))]
    cfg = load(overrides=[f"model.path={path}", *shared])
    engine = VllmEngine(path, cfg.model, cfg.rollout)
    try:
        out = engine.generate(PROMPTS, n=2, seed=5)
        assert not {t for c in out for t in c.token_ids} & set(engine.banned_ids)
        learner = _learner_logprobs(path, PROMPTS, out, cfg.rollout.temperature, banned=True)
        gap = max(_max_gap(c.logprobs, lp) for c, lp in zip(out, learner))

        continuations = [c.token_ids for c in out[::2]]
        before = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
        new, new_model, processor = _named(str(build_tiny_family_judge(tmp_path / "other", arch=arch, seed=1)))
        family = family_of(processor)
        assert any(f".{family.vision_parts[0]}." in k for k in new)
        plan = plan_buckets([(k, v.shape, v.dtype) for k, v in new.items()], 64 << 10)
        engine.load_weights(plan, [pack(b, new) for b in plan])
        expected = _learner_logprobs_on(new_model, processor, PROMPTS, continuations)
        after = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
        synced = max(_max_gap(a, e) for a, e in zip(after, expected))
        moved = min(_max_gap(a, torch.tensor(b)) for a, b in zip(after, before))
        print(f"\n{arch}: served vs learner {gap:.2e}; after a full sync vs new HF {synced:.2e}, moved {moved:.2e}")
        assert gap <= 5e-4 and synced <= 5e-4 and moved > 1e-2, (gap, synced, moved)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_a_tied_judges_head_follows_a_sync_of_its_embedding(arch: str, tmp_path: Path) -> None:
    """Qwen3-VL-4B ties its output projection to the input embedding, and the sync sends that
    tensor once, as embed_tokens (the HF model has no lm_head parameter of its own). After a sync
    in which only the embedding changed, vLLM's log-probs equal the tied HF model's: its head
    moved with the embedding. (Before pjray fed the embedding to the head's own loader too, the
    head kept its CPU-packed copy of the old weights through vLLM's layerwise reload: a gap of
    ~40 nats.)"""
    path = str(build_tiny_judge(tmp_path / arch, arch=arch, seed=0, tied=True))
    cfg = load(overrides=_overrides(arch))
    engine = VllmEngine(path, cfg.model, cfg.rollout)
    try:
        continuations = [engine.generate([p], n=1, seed=0)[0].token_ids for p in PROMPTS]
        old, model, processor = _named(path)
        assert not any(k.startswith("lm_head") for k in old)
        served = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
        expected = _learner_logprobs_on(model, processor, PROMPTS, continuations)
        assert max(_max_gap(a, e) for a, e in zip(served, expected)) <= 1e-4

        # Every weight is sent, as the learner sends them (vLLM's layerwise reload needs them
        # all); only the embedding differs.
        embedding = next(k for k in old if k.endswith("embed_tokens.weight"))
        new = dict(old)
        new[embedding] = old[embedding] + 0.5 * torch.randn(
            old[embedding].shape, generator=torch.Generator().manual_seed(0)
        )
        plan = plan_buckets([(k, v.shape, v.dtype) for k, v in new.items()], 64 << 10)
        engine.load_weights(plan, [pack(b, new) for b in plan])
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(new[embedding])  # the tied head with it
        expected = _learner_logprobs_on(model, processor, PROMPTS, continuations)
        after = [engine.continuation_logprobs(p, c) for p, c in zip(PROMPTS, continuations)]
        gap = max(_max_gap(a, e) for a, e in zip(after, expected))
        moved = min(_max_gap(a, torch.tensor(b)) for a, b in zip(after, served))
        print(
            f"\n{arch} tied: after a sync that changed the embedding only, served vs tied HF {gap:.2e}; moved {moved:.2e}"
        )
        assert gap <= 1e-4 and moved > 1e-2, (gap, moved)
    finally:
        engine.close()


# Of the other families, Idefics3's: its language model is `text_model`, not `language_model`
# (InternVL's and Gemma 3's adapters, named as Qwen-VL's, served alike when measured: 4.8e-7).
@pytest.mark.parametrize("arch", TINY_ARCHS + ("idefics3",))
def test_adapter_sync_serves_a_vision_language_lora_policy(arch: str, tmp_path: Path) -> None:
    """A vision-language judge's LoRA adapter, every language-model linear layer adapted, served by vLLM
    (its LoRA support on its CPU build) on image prompts: before a sync the base judge's
    log-probs, after it the learner's (the text path's tolerance, 2e-3), teacher-forced and
    sampled. A module the engine failed to map would serve the base weights there, off by the
    adapters' change (> 5e-2)."""
    build = build_tiny_family_judge if arch in FAMILY_ARCHS else build_tiny_judge
    path = str(build(tmp_path / arch, arch=arch, seed=0))
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapter", f"model.path={path}"]
    cfg = load(overrides=_overrides(arch if arch in TINY_ARCHS else "qwen2_vl") + lora)
    engine = VllmEngine(path, cfg.model, cfg.rollout)
    try:
        model, processor = load_judge(path, trainable=True, budget=ImageBudget(max_pixels=BUDGET))
        learner = apply_lora(model, cfg.model.lora)
        continuations = [engine.generate([p], n=1, seed=11)[0].token_ids for p in PROMPTS]

        def served() -> list[torch.Tensor]:
            return [torch.tensor(engine.continuation_logprobs(p, c)) for p, c in zip(PROMPTS, continuations)]

        def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
            return max(_max_gap(x, y) for x, y in zip(a, b))

        base = _learner_logprobs_on(learner, processor, PROMPTS, continuations)  # B = 0: the base judge
        assert gap(served(), base) <= 2e-3
        with torch.no_grad():  # the adapters as after training: every B nonzero
            noise = torch.Generator().manual_seed(0)
            for name, p in learner.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=noise))
        message = adapter_update(learner)
        (adapted,) = {n.split(".layers.")[0] for n in message.tensors}  # the language model's alone
        assert adapted in ("base_model.model.model.language_model", "base_model.model.model.text_model")
        assert len(message.tensors) == 2 * sum(".lora_B." in n for n, _ in learner.named_parameters())
        trained = _learner_logprobs_on(learner, processor, PROMPTS, continuations)
        assert gap(trained, base) > 5e-2  # the adapters change what is served: the check can fail
        engine.load_adapter(message)
        after = served()
        print(
            f"\n{arch}: after an adapter sync, served vs learner {gap(after, trained):.2e}; moved {gap(after, base):.2e}"
        )
        assert gap(after, trained) <= 2e-3

        out = engine.generate(PROMPTS, n=2, seed=3)
        sampled = _sampled_logprobs(learner, processor, PROMPTS, out, engine.rollout_cfg.temperature, banned=True)
        assert max(_max_gap(c.logprobs, lp) for c, lp in zip(out, sampled)) <= 2e-3
    finally:
        engine.close()


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU layouts' GRPO runs are tests/integration/test_vllm_gpu.py")
def test_grpo_with_images_and_a_trainable_vision_tower(ray_local, tmp_path: Path) -> None:
    """Three GRPO steps: vLLM rollouts on images (engine core in its own process), DeepSpeed
    learner training every weight (vision tower included), sync by trainer.sync_backend=auto
    (shared memory: one node). At every step the rollout's log-probs are the learner's, on
    images the engine already encoded with the previous step's weights."""
    arch = "qwen3_vl"
    cfg = load(
        overrides=_overrides(arch)
        + [
            f"trainer.run_dir={tmp_path / 'run'}",
            "model.freeze_vision=false",
            "trainer.steps=3",
            "trainer.prompts_per_step=4",
            "trainer.save_every=0",
            "trainer.export_hf=false",
            "trainer.sync_bucket_mb=1",
            "reward.function=learnable_rewards:starts_with_space",
            "algo.group_size=4",
            "learner.micro_batch_size=8",
            "learner.lr=0.05",
            "rollout.num_cpus_per_worker=0.5",
            "learner.num_cpus_per_rank=0.5",
            # 4 items, 4 prompts a step: every step judges the same images again, so a stale
            # encoder cache after a sync would show in logprob_diff.
            "data.num_items=4",
            "data.image_size=64",
            "tracking.wandb=false",
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        assert trainer.layout.transport.name == "shm"
        visual_before = ray.get(trainer.learners[0].checksums.remote())
        trainer.run()
        metrics = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["training/global_step"] for m in metrics] == [1, 2, 3]
        diffs = [m["rollout/logprob_diff_max"] for m in metrics]
        print(f"\n{arch}: GRPO rollout vs learner logprob_diff_max per step {diffs}")
        assert all(0 <= d <= 1e-3 for d in diffs), diffs
        visual_after = ray.get(trainer.learners[0].checksums.remote())
        changed = [k for k in visual_before if k.startswith("model.visual") and visual_before[k] != visual_after[k]]
        assert changed, "the vision tower did not train"
    finally:
        trainer.shutdown()
        os.environ.pop("MASTER_PORT", None)
