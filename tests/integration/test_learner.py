"""The DeepSpeed learner on CPU: batching, the GRPO step, weight export, checkpoints, HF export.

World-size-1 ranks are built directly in the test process (gloo on a free port); the
multi-rank tests run each rank as a Ray actor, as the driver does, and are marked slow.

Adam's first step moves every coordinate by about lr * sign(g), which hides a uniform scale
error in the gradient; so gradient scaling is checked through `actor/grad_norm` (measured
before clipping) against a plain-torch computation, and weights are compared to a tolerance of
a small fraction of lr (coordinates whose gradient is ~0 legitimately differ by rounding).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pjray.config import AlgoConfig, LearnerConfig, ModelConfig, RolloutConfig
from pjray.models.loading import load_judge, placeholder_ids, render_chat
from pjray.models.tiny import build_tiny_judge
from pjray.placement import free_address
from pjray.rl.ds_setup import lr_multiplier
from pjray.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs
from pjray.rl.learner import LearnerRank
from pjray.rl.logprobs import collate, forward_logprobs, forwarded_positions
from pjray.rollout.hf_engine import HFEngine
from pjray.sync.buckets import pack, state_checksums, unpack
from pjray.types import Experience, JudgePrompt
from tests.support.images import noisy_png
from tests.support.prompts import batch_prompt

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LR = 1e-3
# The device a LearnerRank built in this process trains on (a GPU when one is visible), where
# the reference engines and forwards of these tests run too, so that samples are drawn from one
# random stream and log-probs compare like with like.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
# Log-probs of one set of weights from forwards of different batch shapes: they differ in the
# last bits on a CPU; on a GPU the kernels differ by more (2.3e-5 measured on an H200).
LOGP_ATOL = 1e-5 if DEVICE.type == "cpu" else 1e-4
# Weights of two equivalent runs agree to this (see the module docstring).
WEIGHT_ATOL = LR / 20

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR", "OMP_NUM_THREADS")


# ---------------------------------------------------------------------------------------------
# Fixtures and builders
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("judge"), arch="qwen2_vl", seed=0))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def any_arch_judge_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0))


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A LearnerRank built in the test process sets rendezvous variables and thread counts;
    undo both so later tests see the process as it was."""
    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _prompt(user: str, image: bool) -> str:
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>" if image else ""
    return f"<|im_start|>user\n{placeholder}{user}<|im_end|>\n<|im_start|>assistant\n"


def _experiences(n: int, seed: int = 0, advantages: list[float] | None = None) -> list[Experience]:
    """n experiences of varied prompt length, image size (every 4th without image) and
    response length, so batches need real padding."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        image = noisy_png(56 + 28 * (i % 3), 56 + 28 * ((i // 3) % 2), seed * 1000 + i) if i % 4 != 3 else None
        length = rng.randrange(3, 10)
        out.append(
            Experience(
                prompt_text=_prompt("Rank the answers A, B and C. " * (1 + i % 3), image is not None),
                image=image,
                response_ids=tuple(rng.randrange(0, 400) for _ in range(length)),
                advantage=advantages[i] if advantages is not None else rng.uniform(-1.5, 1.5),
            )
        )
    return out


def _dummy() -> Experience:
    """A padding row as the driver makes them: a prompt, no response."""
    return Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)


def _configs(zero_stage: int = 2, micro_batch_size: int = 2, kl_coef: float = 0.0, rollout_is: str = "none") -> tuple:
    """The sections as `pjray.config.load` resolves them (algo.rollout_is never auto)."""
    return (
        ModelConfig(freeze_vision=True),
        LearnerConfig(zero_stage=zero_stage, micro_batch_size=micro_batch_size, lr=LR, grad_clip=1.0),
        AlgoConfig(kl_coef=kl_coef, rollout_is=rollout_is),
    )


def _direct_rank(judge_dir: str, grad_accum_steps: int, micro_batch_size: int, **kw) -> LearnerRank:
    model_cfg, learner_cfg, algo_cfg = _configs(micro_batch_size=micro_batch_size, **kw)
    return LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        judge_dir,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=grad_accum_steps,
    )


def _counts(experiences: list[Experience]) -> tuple[float, float]:
    real = [e for e in experiences if e.response_ids]
    return float(sum(len(e.response_ids) for e in real)), float(len(real))


def _weights(rank: LearnerRank) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in rank.policy.engine.module.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _one_step(judge_dir: str, experiences: list[Experience], grad_accum_steps: int, micro_batch_size: int):
    rank = _direct_rank(judge_dir, grad_accum_steps, micro_batch_size)
    try:
        metrics = rank.train_step(experiences, *_counts(experiences))
        return metrics, _weights(rank)
    finally:
        rank.shutdown()


# ---------------------------------------------------------------------------------------------
# Batching (no DeepSpeed)
# ---------------------------------------------------------------------------------------------


def test_collate_layout(judge_dir: str) -> None:
    _, processor = load_judge(judge_dir, trainable=False)
    exps = _experiences(4)
    exps[1] = dataclasses.replace(exps[1], old_logprobs=tuple(-0.5 - i for i in range(len(exps[1].response_ids))))
    exps.append(_dummy())
    batch = collate(processor, exps)

    B, T = batch.input_ids.shape
    assert B == 5 and batch.attention_mask.shape == batch.response_mask.shape == batch.old_logprobs.shape == (B, T)
    for i, e in enumerate(exps):
        length = int(batch.attention_mask[i].sum())
        assert batch.attention_mask[i, :length].all() and not batch.attention_mask[i, length:].any()
        response = batch.response_mask[i].nonzero().flatten()
        assert len(response) == len(e.response_ids)
        if e.response_ids:
            # The response is the tail of the attended tokens, token for token.
            assert response.tolist() == list(range(length - len(e.response_ids), length))
            assert tuple(batch.input_ids[i, response].tolist()) == e.response_ids
        if e.image is None:
            assert batch.vision[i] == {}
        else:
            grid = batch.vision[i]["image_grid_thw"]
            assert grid.shape == (1, 3) and batch.vision[i]["pixel_values"].shape[0] == int(grid.prod())
            # The placeholder was expanded to (t*h*w)/merge^2 image tokens.
            n_image_tokens = int((batch.input_ids[i] == processor.image_token_id).sum())
            assert n_image_tokens == int(grid.prod()) // processor.image_processor.merge_size**2
    # Given old log-probs land on the response positions; missing ones are NaN ("use current").
    r1 = batch.response_mask[1].bool()
    assert batch.old_logprobs[1, r1].tolist() == list(exps[1].old_logprobs)
    assert torch.isnan(batch.old_logprobs[0, batch.response_mask[0].bool()]).all()
    assert not torch.isnan(batch.old_logprobs[~batch.response_mask.bool()]).any()
    assert batch.ref_logprobs is None
    assert batch.advantages.tolist() == pytest.approx([e.advantage for e in exps])
    # The dummy row is a real, attended prompt with nothing to train on.
    assert batch.response_mask[4].sum() == 0 and batch.attention_mask[4].sum() > 0

    assert collate(processor, exps, pad_to=T + 7).input_ids.shape == (B, T + 7)
    with pytest.raises(ValueError, match="pad_to"):
        collate(processor, exps, pad_to=T - 1)
    with pytest.raises(ValueError, match="old_logprobs"):
        collate(processor, [dataclasses.replace(exps[0], old_logprobs=(0.0,))])


def test_right_padded_batch_matches_unpadded_sequences(any_arch_judge_dir: str) -> None:
    """M-RoPE positions and attention with right padding give each response token the same
    log-prob as the sequence alone; also with a response that contains an image-pad id."""
    model, processor = load_judge(any_arch_judge_dir, trainable=False)
    exps = _experiences(6, seed=3)
    ids = list(exps[2].response_ids)
    ids[1] = processor.image_token_id  # a sampled image-pad id must not be read as an image slot
    exps[2] = dataclasses.replace(exps[2], response_ids=tuple(ids))

    batch = collate(processor, exps, pad_to=None)
    with torch.no_grad():
        batched, _ = forward_logprobs(model, processor, batch)
    mask = batch.response_mask[:, 1:].bool()
    for i, e in enumerate(exps):
        single = collate(processor, [e])
        assert single.attention_mask.all()  # unpadded
        with torch.no_grad():
            alone, _ = forward_logprobs(model, processor, single)
        expected = alone[0][single.response_mask[0, 1:].bool()]
        assert expected.shape == (len(e.response_ids),)
        torch.testing.assert_close(batched[i][mask[i]], expected, atol=1e-5, rtol=0)


def test_only_the_response_positions_are_projected(judge_dir: str) -> None:
    """forward_logprobs runs the output projection over the positions that predict a trained
    response token only, a chunk at a time, and its log-probs, entropies and argmaxes there equal
    the full projection's."""
    from pjray.rl.logprobs import model_inputs as _model_inputs

    model, processor = load_judge(judge_dir, trainable=False)
    batch = collate(processor, _experiences(4, seed=5) + [_dummy()])
    projected: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out.shape[-2]))
    try:
        with torch.no_grad():
            logp, stats = forward_logprobs(
                model, processor, batch, temperature=0.7, shared_prefix=False, chunk_tokens=4
            )
    finally:
        hook.remove()
    with torch.no_grad():
        full = model(**_model_inputs(processor, batch, torch.device("cpu")), use_cache=False).logits[:, :-1] / 0.7
    mask = batch.response_mask[:, 1:].bool()
    n = int(mask.sum())
    assert projected[0] == 0 and projected[1:] == [4] * (n // 4) + ([n % 4] if n % 4 else [])  # the model's own: none
    torch.testing.assert_close(logp[mask], token_logprobs(full, batch.input_ids[:, 1:])[mask], atol=1e-5, rtol=0)
    assert torch.all(logp[~mask] == 0)
    torch.testing.assert_close(stats.entropy, entropy_from_logits(full[mask]), atol=1e-5, rtol=0)
    assert torch.equal(stats.greedy, full[mask].argmax(-1))


def _groups(seed: int, image_token_id: int) -> list[Experience]:
    """GRPO-shaped rows: three prompts (two images of different sizes and prompt lengths, one
    without an image), three responses each of varied length (one with an image-pad id, one
    with an untrained span), and a padding row."""
    rng = random.Random(seed)
    out = []
    for g in range(3):
        image = noisy_png(56 + 28 * g, 56, seed * 100 + g) if g < 2 else None
        prompt = _prompt("Rank the answers A, B and C. " * (1 + g), image is not None)
        for _ in range(3):
            ids = tuple(rng.randrange(0, 400) for _ in range(rng.randrange(2, 9)))
            out.append(Experience(prompt_text=prompt, image=image, response_ids=ids, advantage=rng.uniform(-1.5, 1.5)))
    out[1] = dataclasses.replace(out[1], response_ids=(5, image_token_id, 7, 9))  # a sampled image-pad id
    out[4] = dataclasses.replace(out[4], loss_mask=(True, False) + (True,) * (len(out[4].response_ids) - 2))
    return [*out, _dummy()]


def test_a_shared_prompt_is_forwarded_once_with_the_same_logprobs_and_gradients(any_arch_judge_dir: str) -> None:
    """forward_logprobs with shared_prefix forwards each distinct prompt once (the embedding
    layer sees U prompts plus B responses, not B whole rows) and gives the same log-probs,
    logits and parameter gradients as one forward per row, with M-RoPE positions continuing
    each prompt's."""
    model, processor = load_judge(any_arch_judge_dir, trainable=True)
    exps = _groups(seed=1, image_token_id=processor.image_token_id)
    batch = collate(processor, exps)
    assert batch.prompt_group.tolist() == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9]
    mask = batch.response_mask[:, 1:].bool()
    embedded: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    results = {}
    try:
        for shared in (False, True):
            model.zero_grad()
            embedded.clear()
            logp, stats = forward_logprobs(model, processor, batch, temperature=0.7, shared_prefix=shared)
            (logp * mask * batch.advantages[:, None]).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results[shared] = (logp, stats, grads, sum(embedded))
    finally:
        hook.remove()
    (logp0, stats0, grads0, tokens0), (logp1, stats1, grads1, tokens1) = results[False], results[True]
    torch.testing.assert_close(logp1[mask], logp0[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(stats1.entropy, stats0.entropy, atol=1e-5, rtol=0)
    assert torch.equal(stats1.greedy, stats0.greedy) and stats1.entropy.shape[0] == int(mask.sum())
    assert grads1.keys() == grads0.keys() and grads0
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, atol=1e-5, rtol=1e-4, msg=name)
    B, T = batch.input_ids.shape
    heads = [0, 3, 6, 9]
    R = int((batch.attention_mask.sum(-1) - batch.prompt_lens).max())
    assert tokens0 == B * T
    assert tokens1 == len(heads) * int(batch.prompt_lens[heads].max()) + B * R < tokens0
    # perf/padding_fraction counts what was forwarded.
    assert (
        forwarded_positions(batch, shared=False)[1] == tokens0 and forwarded_positions(batch, shared=True)[1] == tokens1
    )
    padding, total = forwarded_positions(batch, shared=True)
    assert 0 < padding < total and total - padding == int(batch.prompt_lens[heads].sum()) + int(
        batch.attention_mask.sum() - batch.prompt_lens.sum()
    )


@pytest.mark.parametrize(("zero_stage", "checkpointing"), [(2, False), (3, False), (2, True)])
def test_a_step_with_shared_prompts_equals_one_without(
    judge_dir: str, rank_env: None, zero_stage: int, checkpointing: bool
) -> None:
    """The learner's log-probs and update are the same with `learner.shared_prefix` on and off,
    with groups cut across micro-batches, under ZeRO-3's gathered parameters, and under
    gradient checkpointing (which keeps no cache, so the update falls back to whole rows)."""
    _, processor = load_judge(judge_dir, trainable=False)
    exps = _groups(seed=2, image_token_id=processor.image_token_id)
    results = []
    for shared in (False, True):
        model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=zero_stage, micro_batch_size=5)
        model_cfg = dataclasses.replace(model_cfg, gradient_checkpointing=checkpointing)
        learner_cfg = dataclasses.replace(learner_cfg, shared_prefix=shared)
        overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else None
        rank = LearnerRank(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_address()[1],
            total_steps=10,
            grad_accum_steps=2,
            ds_config_overrides=overrides,
        )
        try:
            logprobs = rank.compute_logprobs(exps)
            metrics = rank.train_step(exps, *_counts(exps))
            results.append((logprobs, metrics, rank.compute_logprobs(exps)))
        finally:
            rank.shutdown()
    (before0, metrics0, after0), (before1, metrics1, after1) = results
    for a, b in [*zip(before0, before1), *zip(after0, after1)]:
        assert a == pytest.approx(b, abs=1e-5)
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/num_tokens"):
        assert metrics1[key] == pytest.approx(metrics0[key], rel=1e-5, abs=1e-7), key
    assert max(abs(a - b) for x, y in zip(before0, after0) for a, b in zip(x, y)) > 1e-4  # the step moved


def test_lr_multiplier() -> None:
    assert [lr_multiplier(s, 4, 20, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_multiplier(s, 2, 12, "cosine", 0.1) for s in range(14)]
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cosine[7] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert cosine[12] == pytest.approx(0.1) and cosine[13] == pytest.approx(0.1)  # floor, held
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))


# ---------------------------------------------------------------------------------------------
# One rank, built directly (DeepSpeed ZeRO-2 on gloo)
# ---------------------------------------------------------------------------------------------


def test_step_follows_advantage_sign(judge_dir: str, rank_env: None) -> None:
    exps = _experiences(8, seed=1, advantages=[1.0, -1.0] * 4)
    rank = _direct_rank(judge_dir, grad_accum_steps=2, micro_batch_size=4)
    try:
        before = rank.compute_logprobs(exps)
        metrics = rank.train_step(exps, *_counts(exps))
        after = rank.compute_logprobs(exps)
    finally:
        rank.shutdown()
    change = [sum(a) - sum(b) for a, b in zip(after, before)]
    assert all(c > 0 for c in change[0::2]), change
    assert all(c < 0 for c in change[1::2]), change
    assert metrics["actor/num_tokens"] == _counts(exps)[0] and metrics["actor/num_seqs"] == 8
    assert metrics["actor/lr"] == pytest.approx(LR)
    assert metrics["actor/ppo_kl"] == 0 and metrics["actor/pg_clipfrac"] == 0  # on-policy: ratio 1
    assert metrics["actor/grad_norm"] > 0 and 0 < metrics["actor/entropy"] < 7
    masks = [collate(rank.policy.processor, part).attention_mask for part in (exps[:4], exps[4:])]
    padding = sum(int((m == 0).sum()) for m in masks) / sum(m.numel() for m in masks)
    assert padding > 0 and metrics["perf/padding_fraction"] == pytest.approx(padding)


def test_step_trains_language_model_only(any_arch_judge_dir: str, rank_env: None) -> None:
    """model.freeze_vision finds the vision tower of every supported architecture."""
    exps = _experiences(4, seed=8)
    before = {n: p.detach().clone() for n, p in load_judge(any_arch_judge_dir)[0].named_parameters()}
    _, after = _one_step(any_arch_judge_dir, exps, grad_accum_steps=2, micro_batch_size=2)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and not any(n.startswith("model.visual.") for n in changed)
    assert "lm_head.weight" in changed


def _plain_torch_step(judge_dir: str, exps: list[Experience]) -> tuple[float, float]:
    """(loss, gradient norm) of the full-batch GRPO loss in plain torch, no DeepSpeed."""
    tokens, seqs = _counts(exps)
    model, processor = load_judge(judge_dir)
    model.model.visual.requires_grad_(False)
    batch = collate(processor, exps)
    # The learner's distribution: the placeholder ids banned, as every rollout engine bans them.
    logp, _ = forward_logprobs(model, processor, batch, banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:]
    loss, _ = grpo_loss(logp, logp.detach(), None, batch.advantages, mask, global_tokens=tokens, global_seqs=seqs)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


def test_grad_norm_matches_plain_torch(judge_dir: str, rank_env: None) -> None:
    """DeepSpeed must not divide by the accumulation steps on top of the global-count
    normalisation: the engine's gradient equals the plain full-batch loss gradient."""
    exps = _experiences(6, seed=2)
    loss, norm = _plain_torch_step(judge_dir, exps)
    metrics, _ = _one_step(judge_dir, exps, grad_accum_steps=3, micro_batch_size=2)
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    ("zero_stage", "bf16", "checkpointing"), [(0, False, False), (1, False, True), (3, False, True), (3, True, False)]
)
def test_other_stages_precisions_and_checkpointing(
    judge_dir: str, rank_env: None, tmp_path: Path, zero_stage: int, bf16: bool, checkpointing: bool
) -> None:
    exps = _experiences(4, seed=9)
    _, norm = _plain_torch_step(judge_dir, exps)
    model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=zero_stage)
    model_cfg = dataclasses.replace(
        model_cfg, dtype="bfloat16" if bf16 else "float32", gradient_checkpointing=checkpointing
    )
    learner_cfg = dataclasses.replace(learner_cfg, bf16=bf16)
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        judge_dir,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=2,
    )
    try:
        metrics = rank.train_step(exps, *_counts(exps))
        rank.save_hf(str(tmp_path / "hf"))
        sums = rank.checksums()
    finally:
        rank.shutdown()
    # bf16 rounds the forward; fp32 is exact up to summation order.
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=2e-2 if bf16 else 1e-5)
    reloaded, _ = load_judge(str(tmp_path / "hf"), dtype=model_cfg.dtype)
    assert state_checksums(reloaded.named_parameters()) == sums


def test_step_is_invariant_to_micro_batch_split(judge_dir: str, rank_env: None) -> None:
    exps = _experiences(8, seed=4)
    one_metrics, one = _one_step(judge_dir, exps, grad_accum_steps=1, micro_batch_size=8)
    two_metrics, two = _one_step(judge_dir, exps, grad_accum_steps=2, micro_batch_size=4)
    assert two_metrics["actor/grad_norm"] == pytest.approx(one_metrics["actor/grad_norm"], rel=1e-5)
    assert two_metrics["actor/pg_loss"] == pytest.approx(one_metrics["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert _max_diff(one, two) < WEIGHT_ATOL


def test_token_budget_and_packed_steps_equal_fixed_micro_batches(judge_dir: str, rank_env: None) -> None:
    """Two optimizer steps (ZeRO-2), each of one shard cut three ways: fixed runs of sequences,
    token-budget micro-batches padded, and packed. The budget gives the steps different numbers
    of micro-batches (the accumulation boundary follows); metrics, schedule and weights agree."""
    shards = [_experiences(8, seed=6), _experiences(8, seed=7)]
    _, processor = load_judge(judge_dir, trainable=False)
    lengths = [int(n) for s in shards for n in collate(processor, s).attention_mask.sum(-1)]
    budget = 2 * max(lengths)
    results = []
    for tokens, packing in [(0, False), (budget, False), (budget, True)]:
        model_cfg, learner_cfg, algo_cfg = _configs(micro_batch_size=4)
        learner_cfg = dataclasses.replace(learner_cfg, micro_batch_tokens=tokens, packing=packing, shared_prefix=False)
        rank = LearnerRank(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_address()[1],
            total_steps=10,
            grad_accum_steps=2,
        )
        try:
            metrics = [rank.train_step(s, *_counts(s)) for s in shards]
            results.append((metrics, _weights(rank), rank.policy.engine.global_steps))
        finally:
            rank.shutdown()
    (fixed, fixed_weights, fixed_steps), *budgeted = results
    for metrics, weights, steps in budgeted:
        assert steps == fixed_steps == 2
        for got, want in zip(metrics, fixed):
            for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/num_tokens", "actor/lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert _max_diff(fixed_weights, weights) < WEIGHT_ATOL
    packed = budgeted[1][0]
    assert all(m["perf/padding_fraction"] == 0 for m in packed)
    for shard, metrics in zip(shards, fixed):
        masks = [collate(processor, part).attention_mask for part in (shard[:4], shard[4:])]
        padding = sum(int((m == 0).sum()) for m in masks) / sum(m.numel() for m in masks)
        assert padding > 0 and metrics["perf/padding_fraction"] == pytest.approx(padding)


def test_dummy_experiences_contribute_nothing(judge_dir: str, rank_env: None) -> None:
    exps = _experiences(4, seed=5)
    # Dummies in between real rows, and a micro-batch made of dummies only.
    padded = [exps[0], _dummy(), exps[1], exps[2], _dummy(), exps[3], _dummy(), _dummy()]
    plain_metrics, plain = _one_step(judge_dir, exps, grad_accum_steps=2, micro_batch_size=2)
    padded_metrics, with_dummies = _one_step(judge_dir, padded, grad_accum_steps=4, micro_batch_size=2)
    assert padded_metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=1e-5)
    assert padded_metrics["actor/num_tokens"] == plain_metrics["actor/num_tokens"]
    assert padded_metrics["actor/num_seqs"] == 4
    assert _max_diff(plain, with_dummies) < WEIGHT_ATOL


def test_checkpoint_and_hf_export(judge_dir: str, rank_env: None, tmp_path: Path) -> None:
    exps = _experiences(4, seed=6)
    counts = _counts(exps)
    rank = _direct_rank(judge_dir, grad_accum_steps=2, micro_batch_size=2, kl_coef=0.01)
    try:
        exps = [dataclasses.replace(e, ref_logprobs=r) for e, r in zip(exps, rank.compute_logprobs(exps, "ref"))]
        rank.train_step(exps, *counts)
        rank.save_checkpoint(str(tmp_path / "ckpt"), {"step": 1, "note": "x"})
        second = rank.train_step(exps, *counts)  # moves the weights, the Adam moments and the LR step
        after_second = rank.checksums()
        assert second["actor/kl_loss"] > 0  # the policy moved away from the reference

        assert rank.load_checkpoint(str(tmp_path / "ckpt")) == {"step": 1, "note": "x"}
        again = rank.train_step(exps, *counts)
        assert rank.checksums() == after_second  # bit-identical: optimizer state came back too
        assert again == second

        rank.save_hf(str(tmp_path / "hf"))
        policy_logprobs = rank.compute_logprobs(exps)
        sums = rank.checksums()
    finally:
        rank.shutdown()

    from transformers import AutoModelForImageTextToText

    plain = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"))
    assert state_checksums(plain.named_parameters()) == sums
    model, processor = load_judge(str(tmp_path / "hf"), trainable=False)
    batch = collate(processor, exps)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, processor, batch, banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:].bool()
    for i, expected in enumerate(policy_logprobs):
        # Same weights (the checksums above are exact); the batch's shape differs from the
        # rank's micro-batches, so the projection's float rounding may differ in the last bit.
        torch.testing.assert_close(logp[i][mask[i]], torch.tensor(expected), atol=LOGP_ATOL, rtol=0)


def _policy_logprobs(model, processor, exps: list[Experience]) -> list[torch.Tensor]:
    batch = collate(processor, exps)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, processor, batch, banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:].bool()
    return [logp[i][mask[i]] for i in range(len(exps))]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_a_tied_judge_trains_syncs_and_exports_tied(arch: str, rank_env: None, tmp_path: Path) -> None:
    """Qwen3-VL-4B ties its output projection to the input embedding. After a step the learner's
    two are still one tensor, the sync sends it once (as embed_tokens; there is no lm_head
    parameter of its own), an HF engine that loads the sync computes the learner's log-probs (its
    head followed the embedding), and the HF export reloads tied with the same log-probs."""
    from transformers import AutoModelForImageTextToText

    path = str(build_tiny_judge(tmp_path / arch, arch=arch, seed=0, tied=True))
    exps = _experiences(4, seed=7)
    rank = _direct_rank(path, grad_accum_steps=2, micro_batch_size=2)
    try:
        module = rank.policy.engine.module
        assert module.get_output_embeddings().weight is module.get_input_embeddings().weight
        before = module.get_input_embeddings().weight.detach().clone()
        rank.train_step(exps, *_counts(exps))
        assert module.get_output_embeddings().weight is module.get_input_embeddings().weight
        assert not torch.equal(module.get_input_embeddings().weight.detach(), before)  # the tied tensor trained
        buckets = list(rank.weights.full_buckets(64 << 10))
        plan = [b for b, _ in buckets]
        names = [e.name for b in plan for e in b.entries]
        assert "lm_head.weight" not in names and sum("embed_tokens" in n for n in names) == 1, names
        packed = [pack(b, tensors).cpu() for b, tensors in buckets]
        policy = [torch.tensor(lp) for lp in rank.compute_logprobs(exps)]
        rank.save_hf(str(tmp_path / "hf"))
    finally:
        rank.shutdown()

    engine = HFEngine(path, ModelConfig(), RolloutConfig(backend="hf"))
    stale = _policy_logprobs(engine.model, engine.processor, exps)
    engine.load_weights(plan, packed)
    assert engine.model.get_output_embeddings().weight is engine.model.get_input_embeddings().weight
    synced = _policy_logprobs(engine.model, engine.processor, exps)
    assert max(float((a - b).abs().max()) for a, b in zip(stale, policy)) > 1e-4  # the step moved them
    for got, expected in zip(synced, policy):
        torch.testing.assert_close(got, expected, atol=LOGP_ATOL, rtol=0)

    plain = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"))
    assert plain.config.tie_word_embeddings
    assert plain.get_output_embeddings().weight.data_ptr() == plain.get_input_embeddings().weight.data_ptr()
    model, processor = load_judge(str(tmp_path / "hf"), trainable=False)
    for got, expected in zip(_policy_logprobs(model, processor, exps), policy):
        torch.testing.assert_close(got, expected, atol=LOGP_ATOL, rtol=0)


def test_lr_schedule_advances_once_per_optimizer_step(judge_dir: str, rank_env: None) -> None:
    model_cfg, learner_cfg, algo_cfg = _configs()
    learner_cfg = dataclasses.replace(learner_cfg, warmup_steps=4)
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        judge_dir,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=3,
    )
    try:
        exps = _experiences(6)
        lrs = [rank.train_step(exps, *_counts(exps))["actor/lr"] for _ in range(3)]
    finally:
        rank.shutdown()
    assert lrs == pytest.approx([LR * 0.25, LR * 0.5, LR * 0.75])


def test_bad_calls_fail_loudly(judge_dir: str, rank_env: None) -> None:
    rank = _direct_rank(judge_dir, grad_accum_steps=2, micro_batch_size=2, kl_coef=0.01)
    try:
        exps = _experiences(4)
        with pytest.raises(ValueError, match="ref_logprobs"):
            rank.train_step(exps, *_counts(exps))
        with pytest.raises(ValueError, match="micro-batches"):
            rank.train_step(exps[:1], *_counts(exps[:1]))
        with pytest.raises(ValueError, match="which"):
            rank.compute_logprobs(exps, "old")
    finally:
        rank.shutdown()


def _sharpen(path: Path) -> None:
    """Scale every matrix of a saved tiny judge by 10: its logits then spread over several nats,
    so scoring them at the wrong temperature is far off (a random judge is nearly uniform)."""
    weights = load_file(path / "model.safetensors")
    save_file(
        {k: v * 10 if v.dim() >= 2 else v for k, v in weights.items()},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )


def test_logprobs_at_the_rollout_temperature_match_the_engine(tmp_path: Path, rank_env: None) -> None:
    """Responses sampled by the HF engine at T=0.7: the learner's current and reference
    log-probs of them equal the engine's, and so does the forward of train_step (its
    rollout/logprob_diff_max ~ 0, its entropy that of logits / T without the placeholders,
    which both sides ban); raw logits are far off."""
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    _sharpen(judge)
    engine = HFEngine(str(judge), ModelConfig(), RolloutConfig(max_new_tokens=8, temperature=0.7), device=str(DEVICE))
    prompts = [
        batch_prompt(str(i), "Judge.", user, image)
        for i, (user, image) in enumerate(
            [("Rank the answers A, B and C.", noisy_png(84, 56, 3)), ("No image here.", None)]
        )
    ]
    completions = engine.generate(prompts, n=3, seed=0)
    exps = [
        Experience(
            prompt_text=render_chat(engine.processor, prompts[c.prompt_index]),
            image=prompts[c.prompt_index].image,
            response_ids=c.token_ids,
            advantage=(-1.0) ** c.sample_index,
            rollout_logprobs=c.logprobs,
        )
        for c in completions
    ]
    model_cfg, learner_cfg, algo_cfg = _configs(micro_batch_size=3, kl_coef=0.01, rollout_is="token")  # an engine apart
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        str(judge),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=2,
        temperature=0.7,
    )
    try:
        policy = rank.compute_logprobs(exps)
        ref = rank.compute_logprobs(exps, "ref")
        batch = collate(rank.policy.processor, exps)
        mask = batch.response_mask[:, 1:].bool()
        with torch.no_grad():
            raw, _ = forward_logprobs(rank.policy.engine, rank.policy.processor, batch, DEVICE, temperature=1.0)
            _, scaled = forward_logprobs(
                rank.policy.engine, rank.policy.processor, batch, DEVICE, temperature=0.7, banned=rank.policy.banned
            )
            entropy = float(scaled.entropy.mean())
        exps = [dataclasses.replace(e, ref_logprobs=r) for e, r in zip(exps, ref)]
        metrics = rank.train_step(exps, *_counts(exps))
    finally:
        rank.shutdown()
    for c, lp, rp in zip(completions, policy, ref):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(rp), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
    raw_diff = max(
        float((raw[i].cpu()[mask[i]] - torch.tensor(c.logprobs)).abs().max()) for i, c in enumerate(completions)
    )
    assert raw_diff > 0.1, raw_diff
    assert (
        metrics["rollout/logprob_diff_max"] < 1e-4
        and metrics["rollout/logprob_diff_mean"] <= metrics["rollout/logprob_diff_max"]
    )
    assert metrics["actor/entropy"] == pytest.approx(entropy, rel=1e-4)


def test_rollout_correction_weighs_the_engines_samples_and_gspo_trains(tmp_path: Path, rank_env: None) -> None:
    """Engine log-probs shifted by a known amount from the learner's (+1 on even response tokens,
    -0.3 on odd): with algo.rollout_is=token (TIS at 2) the step's rollout_is/* equal the
    formulas on those shifts (weights min(e^d, 2): e^1 truncated, e^-0.3 kept). Then the same
    rank with GSPO and sequence-level IcePop takes a step: one weight a sequence, the sequence
    whose engine log-probs are off dropped, the others trained."""
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    engine = HFEngine(str(judge), ModelConfig(), RolloutConfig(max_new_tokens=8), device=str(DEVICE))
    prompts = [
        JudgePrompt(
            item_id="0",
            system="Judge.",
            user="Rank the answers A, B and C.",
            image=noisy_png(84, 56, 3),
            protocol="batch",
            style="ranking",
            num_candidates=3,
            shown=(0, 1, 2),
            target="ABC",
        )
    ]
    completions = engine.generate(prompts, n=4, seed=0)
    exps = [
        Experience(
            prompt_text=render_chat(engine.processor, prompts[0]),
            image=prompts[0].image,
            response_ids=c.token_ids,
            advantage=(-1.0) ** c.sample_index,
        )
        for c in completions
    ]
    model_cfg, learner_cfg, _ = _configs(micro_batch_size=2)
    algo_cfg = AlgoConfig(kl_coef=0.0, rollout_is="token", rollout_is_upper=2.0)
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        str(judge),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=2,
    )
    try:
        policy = rank.compute_logprobs(exps)
        shifts = [tuple(1.0 if t % 2 == 0 else -0.3 for t in range(len(lp))) for lp in policy]
        shifted = [
            dataclasses.replace(e, rollout_logprobs=tuple(p - d for p, d in zip(lp, ds)))
            for e, lp, ds in zip(exps, policy, shifts)
        ]
        tis = rank.train_step(shifted, *_counts(shifted))
        rank.algo_cfg = dataclasses.replace(
            algo_cfg,
            policy_loss="gspo",
            loss_agg="seq-mean-token-mean",
            clip_low=3e-4,
            clip_high=4e-4,
            rollout_is="sequence",
            rollout_is_lower=0.5,
        )
        # The engine's log-probs as the learner's now, but the first response's 0.5 lower per
        # token: its sequence weight e^(0.5 n) leaves the band and IcePop drops it.
        current = rank.compute_logprobs(exps)
        engine = [tuple(p - (0.5 if i == 0 else 0.0) for p in lp) for i, lp in enumerate(current)]
        matched = [dataclasses.replace(e, rollout_logprobs=lp) for e, lp in zip(exps, engine)]
        gspo = rank.train_step(matched, *_counts(matched))
    finally:
        rank.shutdown()
    flat = [d for ds in shifts for d in ds]
    weights = [min(math.exp(d), 2.0) for d in flat]
    assert tis["rollout_is/units"] == len(flat)
    assert tis["rollout_is/mean"] == pytest.approx(sum(weights) / len(flat), abs=1e-3)
    assert tis["rollout_is/max"] == pytest.approx(math.e, abs=1e-2)
    assert tis["rollout_is/frac_clipped"] == pytest.approx(sum(d > 0 for d in flat) / len(flat))
    assert tis["rollout_is/ess"] == pytest.approx(
        sum(weights) ** 2 / (len(flat) * sum(w * w for w in weights)), abs=1e-3
    )
    assert tis["rollout/logprob_diff_max"] == pytest.approx(1.0, abs=1e-3)
    assert gspo["rollout_is/units"] == len(exps)
    assert gspo["rollout_is/frac_clipped"] == pytest.approx(1 / len(exps))
    assert gspo["rollout_is/max"] == pytest.approx(math.exp(0.5 * len(current[0])), rel=1e-2)
    assert math.isfinite(gspo["actor/pg_loss"]) and gspo["actor/grad_norm"] > 0


# ---------------------------------------------------------------------------------------------
# Two ranks as Ray actors (as the driver launches them)
# ---------------------------------------------------------------------------------------------


def _launch(judge_dir: str, zero_stage: int, world_size: int, grad_accum_steps: int, **learner: Any) -> list:
    import ray

    model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=zero_stage, micro_batch_size=2, kl_coef=0.01)
    # Chunks of 4 positions: the ranks' micro-batches need different numbers of them, and under
    # ZeRO-3 each projection gathers the head's weight (the ranks must call it as often).
    learner_cfg = dataclasses.replace(learner_cfg, **{"logit_chunk_tokens": 4, **learner})
    # Tiny parameters fall under ZeRO-3's persistence threshold and would never be partitioned;
    # 0 makes every parameter a real shard, so the gathers are exercised.
    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else None
    port = free_address()[1]
    remote = ray.remote(num_cpus=0.5)(LearnerRank)
    ranks = [
        remote.remote(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=r,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=port,
            total_steps=10,
            grad_accum_steps=grad_accum_steps,
            ds_config_overrides=overrides,
        )
        for r in range(world_size)
    ]
    ray.get([r.ready.remote() for r in ranks])
    return ranks


def _call(ranks: list, method: str, *per_rank_args, timeout: float | None = None) -> list:
    """Call `method` on every rank (collectives need all of them); per_rank_args[i] is a list
    of rank i's arguments, or a plain value shared by all. Ranks stuck in a collective fail the
    call after `timeout` seconds."""
    import ray

    refs = []
    for i, r in enumerate(ranks):
        args = [a[i] if isinstance(a, tuple) else a for a in per_rank_args]
        refs.append(getattr(r, method).remote(*args))
    return ray.get(refs, timeout=timeout)


def _exported(ranks: list) -> dict[str, torch.Tensor]:
    import ray

    results = _call(ranks, "export_weights", 4096)
    assert all(r is None for r in results[1:])
    plan, refs = results[0]
    assert len(plan) > 1  # several buckets at 4 KiB
    weights: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan, ray.get(refs)):
        weights.update({k: v.clone() for k, v in unpack(bucket, flat).items()})
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_match_one_rank(judge_dir: str, zero_stage: int, ray_local: None, tmp_path: Path) -> None:
    import ray

    exps = _experiences(8, seed=7)
    counts = _counts(exps)
    pair = _launch(judge_dir, zero_stage, world_size=2, grad_accum_steps=2)
    single = _launch(judge_dir, zero_stage, world_size=1, grad_accum_steps=4)
    if zero_stage == 3:
        held = _call(pair, "__ray_call__", lambda rank: sum(p.numel() for p in rank.policy.engine.module.parameters()))
        full = sum(p.numel() for p in load_judge(judge_dir)[0].parameters())
        assert max(held) < full  # really sharded

    def shards(items: list) -> tuple:
        return (items[:4], items[4:])

    # Reference log-probs: the sharded reference model agrees with the unsharded one.
    ref_single = _call(single, "compute_logprobs", (exps,), "ref")[0]
    ref_pair = [lp for part in _call(pair, "compute_logprobs", shards(exps), "ref") for lp in part]
    for a, b in zip(ref_single, ref_pair):
        assert a == pytest.approx(b, abs=1e-6)
    exps = [dataclasses.replace(e, ref_logprobs=r) for e, r in zip(exps, ref_single)]
    # Rollout log-probs from before the first update make the second step off-policy (ratio != 1).
    old = _call(single, "compute_logprobs", (exps,), "policy")[0]
    stale = [dataclasses.replace(e, old_logprobs=lp) for e, lp in zip(exps, old)]

    for step_exps in (exps, stale):
        pair_metrics = _call(pair, "train_step", shards(step_exps), *counts)
        single_metrics = _call(single, "train_step", (step_exps,), *counts)[0]
        assert pair_metrics[0] == pair_metrics[1]
        for key, value in single_metrics.items():
            assert pair_metrics[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert pair_metrics[0]["actor/ppo_kl"] != 0 and pair_metrics[0]["actor/kl_loss"] > 0

    # Replicas agree, the export is what checksums() reports, and it matches the 1-rank run.
    per_rank = _call(pair, "checksums", True)
    assert per_rank[0] == per_rank[1]
    exported = _exported(pair)
    assert state_checksums(exported) == per_rank[0] == _call(pair, "checksums")[0]
    assert _call(pair, "checksums")[1] == {}
    assert _max_diff(exported, _exported(single)) < WEIGHT_ATOL

    # The exported names and shapes load strictly into a freshly loaded HF model.
    fresh, processor = load_judge(judge_dir, trainable=False)
    fresh.load_state_dict(exported, strict=True)
    assert state_checksums(fresh.named_parameters()) == per_rank[0]

    # Checkpoint: a further step from the saved state and from the reloaded one agree exactly.
    ckpt = str(tmp_path / "ckpt")
    _call(pair, "save_checkpoint", ckpt, {"step": 2})
    further = _call(pair, "train_step", shards(stale), *counts)
    after = _call(pair, "checksums")[0]
    assert _call(pair, "load_checkpoint", ckpt) == [{"step": 2}, {"step": 2}]
    assert _call(pair, "train_step", shards(stale), *counts) == further
    assert _call(pair, "checksums")[0] == after

    # HF export from the sharded ranks reloads with identical weights and log-probs.
    hf_dir = str(tmp_path / "hf")
    _call(pair, "save_hf", hf_dir)
    from transformers import AutoModelForImageTextToText

    reloaded = AutoModelForImageTextToText.from_pretrained(hf_dir)
    assert state_checksums(reloaded.named_parameters()) == after
    policy = [lp for part in _call(pair, "compute_logprobs", shards(exps), "policy") for lp in part]
    batch = collate(processor, exps)
    with torch.no_grad():
        logp, _ = forward_logprobs(reloaded.eval(), processor, batch, banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:].bool()
    for i, expected in enumerate(policy):
        assert logp[i][mask[i]].tolist() == pytest.approx(list(expected), abs=1e-6)

    for r in pair + single:
        ray.kill(r)


def _shard(kind: str, size: int, processor: Any) -> list[Experience]:
    """groups: two GRPO groups of three (size 6), with images; distinct: `size` prompts, every
    fourth without an image; text: `size` prompts without images."""
    if kind == "groups":
        rows = [e for e in _groups(seed=3, image_token_id=processor.image_token_id) if e.response_ids][:size]
        return [dataclasses.replace(e, loss_mask=None) for e in rows]
    return [
        dataclasses.replace(
            e,
            prompt_text=_prompt(
                f"Rank the answers to {kind} question {i}.", e.image is not None and kind == "distinct"
            ),
            image=e.image if kind == "distinct" else None,
        )
        for i, e in enumerate(_experiences(size, seed=4))
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("shards", "budget"), [("groups/distinct", 0), ("groups/distinct", 150), ("distinct/text", 0)])
def test_zero3_ranks_whose_shards_differ_stay_in_step(
    judge_dir: str, shards: str, budget: int, ray_local: None
) -> None:
    """Under ZeRO-3 every forward gathers the parameters it runs, so every rank must run the
    same forwards. groups/distinct: rank 0's shard holds GRPO groups (a prompt forwarded once
    for its three responses: two forwards a micro-batch), rank 1's distinct prompts (one
    forward each), with fixed micro-batches and under a token budget
    (`learner.micro_batch_tokens`, which cuts the shards into different counts). distinct/text:
    rank 0's micro-batches hold images, rank 1's text alone (no vision tower). Both ranks finish
    their log-probs (a shard of half the length too) and a step, with the log-probs and metrics
    of one rank holding every row, and a step on shards of different lengths."""
    import ray

    _, processor = load_judge(judge_dir, trainable=False)
    first, second = (_shard(kind, 6, processor) for kind in shards.split("/"))
    assert len({e.prompt_text for e in first + second}) == (8 if shards == "groups/distinct" else 12)
    rows = first + second
    pair = _launch(judge_dir, 3, world_size=2, grad_accum_steps=2, micro_batch_tokens=budget)
    single = _launch(judge_dir, 3, world_size=1, grad_accum_steps=4, micro_batch_tokens=budget)
    try:
        want = {}
        for which in ("ref", "policy"):
            got = _call(pair, "compute_logprobs", (first, second), which, timeout=120)
            want[which] = _call(single, "compute_logprobs", (rows,), which)[0]
            for a, b in zip([lp for part in got for lp in part], want[which], strict=True):
                assert a == pytest.approx(b, abs=1e-5)
        half = _call(pair, "compute_logprobs", (first, second[:3]), "policy", timeout=120)
        for a, b in zip([lp for part in half for lp in part], want["policy"][:9], strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        rows = [dataclasses.replace(e, ref_logprobs=lp) for e, lp in zip(rows, want["ref"])]
        pair_metrics = _call(pair, "train_step", (rows[:6], rows[6:]), *_counts(rows), timeout=120)
        single_metrics = _call(single, "train_step", (rows,), *_counts(rows))[0]
        assert pair_metrics[0] == pair_metrics[1]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/num_tokens"):
            assert pair_metrics[0][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
        # Shards of different lengths: micro-batches of different sizes, whose trained tokens
        # need different numbers of output-projection chunks (the fewer padded with zero rows).
        uneven = _call(pair, "train_step", (rows[:6], rows[6:9]), *_counts(rows[:9]), timeout=120)
        assert uneven[0] == uneven[1] and uneven[0]["actor/num_tokens"] == _counts(rows[:9])[0]
    finally:
        for r in pair + single:
            ray.kill(r)


# ---------------------------------------------------------------------------------------------
# The hybrid engine: learner ranks generate with the module they train
# ---------------------------------------------------------------------------------------------

HYBRID_ROLLOUT = RolloutConfig(backend="hybrid", max_new_tokens=8, temperature=0.7)


def _judge_prompts(count: int) -> list[JudgePrompt]:
    return [
        JudgePrompt(
            item_id=str(i),
            system="Judge.",
            user=f"Rank the answers A, B and C. ({i})",
            image=noisy_png(84, 56, i) if i % 2 == 0 else None,
            protocol="batch",
            style="ranking",
            num_candidates=3,
            shown=(0, 1, 2),
            target="ABC",
        )
        for i in range(count)
    ]


def _same_completions(got: list, want: list) -> None:
    assert [(c.prompt_index, c.sample_index, c.token_ids, c.finish_reason) for c in got] == [
        (c.prompt_index, c.sample_index, c.token_ids, c.finish_reason) for c in want
    ]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGP_ATOL, rtol=0)


def test_hybrid_generation_equals_the_hf_engine(tmp_path: Path, rank_env: None) -> None:
    """A rank built with a rollout config samples exactly what the split HF engine samples from
    the same weights and seed, before and after an update; generating leaves the module in
    training mode with its own generation config, and the next update still trains."""
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    _sharpen(judge)
    prompts = _judge_prompts(3)
    model_cfg, learner_cfg, algo_cfg = _configs(micro_batch_size=3)
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        str(judge),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=2,
        temperature=0.7,
        rollout_cfg=HYBRID_ROLLOUT,
    )
    try:
        own_config = rank.policy.engine.module.generation_config
        hybrid = rank.generate(prompts, n=2, seed=11)
        split = HFEngine(str(judge), ModelConfig(), HYBRID_ROLLOUT, device=str(DEVICE)).generate(prompts, n=2, seed=11)
        _same_completions(hybrid, split)
        assert rank.policy.engine.training and rank.policy.engine.module.generation_config is own_config

        exps = [
            Experience(
                prompt_text=render_chat(rank.policy.processor, prompts[c.prompt_index]),
                image=prompts[c.prompt_index].image,
                response_ids=c.token_ids,
                advantage=(-1.0) ** c.sample_index,
                rollout_logprobs=c.logprobs,
            )
            for c in hybrid
        ]
        metrics = rank.train_step(exps, *_counts(exps))
        assert metrics["rollout/logprob_diff_max"] < 1e-4  # the hybrid's log-probs are the learner's
        rank.save_hf(str(tmp_path / "after"))
        after = rank.generate(prompts, n=2, seed=11)
        after_engine = HFEngine(str(tmp_path / "after"), ModelConfig(), HYBRID_ROLLOUT, device=str(DEVICE))
        _same_completions(after, after_engine.generate(prompts, n=2, seed=11))
        assert [c.logprobs for c in after] != [c.logprobs for c in hybrid]  # it samples the new weights
    finally:
        rank.shutdown()


def test_a_rank_without_a_rollout_config_does_not_generate(judge_dir: str, rank_env: None) -> None:
    rank = _direct_rank(judge_dir, grad_accum_steps=1, micro_batch_size=2)
    try:
        with pytest.raises(ValueError, match="rollout.backend=hybrid"):
            rank.generate(_judge_prompts(1), n=1, seed=0)
    finally:
        rank.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["full", "layer"])
def test_hybrid_zero3_ranks_generate_what_the_hf_engine_does(judge_dir: str, gather: str, ray_local: None) -> None:
    """Two ZeRO-3 ranks (every parameter sharded) generate through the pool interface: with
    more prompts than ranks and with fewer (the idle rank joins with a filler prompt), and with
    more generate calls on one rank than on the other, each chunk equals the HF engine's sample
    of it at that worker's seed."""
    import ray

    from pjray.placement import RankGroup
    from pjray.rollout.worker import generate_with_pool

    rollout_cfg = dataclasses.replace(HYBRID_ROLLOUT, hybrid_gather=gather)
    model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=3, micro_batch_size=2)
    port = free_address()[1]
    ranks = [
        ray.remote(num_cpus=0.5)(LearnerRank).remote(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=r,
            world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            total_steps=10,
            grad_accum_steps=1,
            temperature=0.7,
            rollout_cfg=rollout_cfg,
            ds_config_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        )
        for r in range(2)
    ]
    try:
        ray.get([r.ready.remote() for r in ranks])
        engine = HFEngine(judge_dir, ModelConfig(), rollout_cfg)
        group = RankGroup(ranks)
        prompts = _judge_prompts(3)
        got = generate_with_pool(group, prompts, 2, seed=4).value
        want = engine.generate(prompts[:2], 2, 4_000) + [
            dataclasses.replace(c, prompt_index=2) for c in engine.generate(prompts[2:], 2, 4_001)
        ]
        _same_completions(got, want)
        alone = generate_with_pool(group, prompts[1:2], 3, seed=9).value
        _same_completions(alone, engine.generate(prompts[1:2], 3, 9_000))
        if gather == "layer":
            return  # one synced generate call a rank, whatever its prompts
        # Nine prompts beside eight: the first rank generates in two calls of its engine (at most
        # eight prompts each), the second in one.
        many = _judge_prompts(17)
        chunks = (many[:9], many[9:])
        got = ray.get(
            [r.generate.remote(chunk, 1, 5_000 + w) for w, (r, chunk) in enumerate(zip(ranks, chunks))], timeout=120
        )
        for w, chunk in enumerate(chunks):
            _same_completions(got[w], engine.generate(chunk, 1, 5_000 + w))
    finally:
        for r in ranks:
            ray.kill(r)


# ---------------------------------------------------------------------------------------------
# LoRA: only the adapters train; reference = adapters off; merged weights leave the rank
# ---------------------------------------------------------------------------------------------


def test_lora_trains_only_adapters_and_exports_merged_weights(judge_dir: str, rank_env: None, tmp_path: Path) -> None:
    from pjray.config import LoraConfig

    model_cfg, learner_cfg, algo_cfg = _configs(micro_batch_size=2, kl_coef=0.01)
    model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, alpha=8.0))
    learner_cfg = dataclasses.replace(learner_cfg, lr=0.05)
    rollout_cfg = dataclasses.replace(HYBRID_ROLLOUT, max_new_tokens=6)
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        judge_dir,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=2,
        temperature=0.7,
        rollout_cfg=rollout_cfg,
    )
    try:
        base = load_judge(judge_dir, trainable=False)[0]
        base_sums = state_checksums(base.named_parameters())
        assert rank.checksums() == base_sums  # fresh adapters (B = 0) change nothing
        trainable = [n for n, p in rank.policy.engine.module.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)
        assert not any("visual" in n for n in trainable)  # no adapters in the vision tower

        exps = _experiences(4, seed=2)
        ref = rank.compute_logprobs(exps, "ref")
        exps = [dataclasses.replace(e, ref_logprobs=r) for e, r in zip(exps, ref)]
        frozen_before = {
            n: p.detach().clone() for n, p in rank.policy.engine.module.named_parameters() if not p.requires_grad
        }
        for _ in range(2):
            metrics = rank.train_step(exps, *_counts(exps))
        assert metrics["actor/kl_loss"] > 0  # the adapters moved the policy away from the base
        frozen_after = {n: p for n, p in rank.policy.engine.module.named_parameters() if not p.requires_grad}
        assert all(torch.equal(frozen_before[n], frozen_after[n]) for n in frozen_before)  # base untouched
        assert rank.compute_logprobs(exps, "ref") == ref  # the reference is still the base

        merged = {
            name: t.to("cpu", copy=True)
            for _, tensors in rank.weights.full_buckets(4096)
            for name, t in tensors.items()
        }
        assert merged.keys() == dict(base.named_parameters()).keys()  # plain HF names
        changed = [n for n, t in merged.items() if not torch.equal(t, dict(base.named_parameters())[n])]
        assert changed and all("language_model" in n or ".layers." in n for n in changed), changed[:3]
        policy = rank.compute_logprobs(exps)
        samples = rank.generate(_judge_prompts(2), n=2, seed=3)
        rank.save_hf(str(tmp_path / "hf"))
    finally:
        rank.shutdown()

    assert (tmp_path / "hf" / "adapter" / "adapter_config.json").is_file()
    exported, processor = load_judge(str(tmp_path / "hf"), trainable=False)
    assert state_checksums(exported.named_parameters()) == state_checksums(merged)
    batch = collate(processor, exps)
    with torch.no_grad():
        logp, _ = forward_logprobs(exported, processor, batch, temperature=0.7, banned=placeholder_ids(processor))
    mask = batch.response_mask[:, 1:].bool()
    for i, expected in enumerate(policy):
        torch.testing.assert_close(logp[i][mask[i]], torch.tensor(expected), atol=LOGP_ATOL, rtol=0)
    # The hybrid engine sampled with the adapters on: what the merged export samples.
    exported_engine = HFEngine(str(tmp_path / "hf"), ModelConfig(), rollout_cfg, device=str(DEVICE))
    _same_completions(samples, exported_engine.generate(_judge_prompts(2), n=2, seed=3))


def test_sharded_models_load_partitioned_with_the_replicated_ones_logprobs(
    judge_dir: str, rank_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ZeRO-3 engine's model (the policy under learner.zero_stage=3, the reference under it or
    learner.shard_reference) is loaded partitioned: every parameter arrives from
    `from_pretrained` as a ZeRO-3 placeholder, so no rank holds the whole model, while the
    whole models of ZeRO-2 load as before. The policy's and the reference's log-probs equal the
    whole copies', before and after a step (the reference does not move with the policy), and no
    DeepSpeed config is left to partition later loads in the process."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    import pjray.rl.policy as policy_module

    loads: list[tuple[bool, bool]] = []  # (trainable, partitioned) of each load

    def recording_load(*args, **kwargs):
        model, processor = load_judge(*args, **kwargs)
        params = list(model.parameters())
        partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
        assert partitioned or not any(hasattr(p, "ds_id") for p in params)
        loads.append((kwargs["trainable"], partitioned))
        return model, processor

    monkeypatch.setattr(policy_module, "load_judge", recording_load)
    exps = _experiences(6, seed=8)
    results, loaded = [], []
    for zero_stage, shard in ((2, False), (2, True), (3, False)):
        loads.clear()
        model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=zero_stage, micro_batch_size=3, kl_coef=0.01)
        learner_cfg = dataclasses.replace(learner_cfg, shard_reference=shard)
        rank = LearnerRank(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_address()[1],
            total_steps=10,
            grad_accum_steps=2,
        )
        try:
            assert not is_deepspeed_zero3_enabled()
            assert hasattr(rank.policy.ref, "zero_optimization_partition_weights") == (shard or zero_stage == 3)
            loaded.append(list(loads))
            policy = rank.compute_logprobs(exps, "policy")
            before = rank.compute_logprobs(exps, "ref")
            with_ref = [dataclasses.replace(e, ref_logprobs=r) for e, r in zip(exps, before)]
            rank.train_step(with_ref, *_counts(with_ref))
            results.append((policy, before, rank.compute_logprobs(exps, "ref")))
        finally:
            rank.shutdown()
    assert loaded == [[(True, False), (False, False)], [(True, False), (False, True)], [(True, True), (False, True)]]
    (whole_policy, whole_before, whole_after), *sharded = results
    for policy, before, after in sharded:
        for a, b in [
            *zip(whole_policy, policy),
            *zip(whole_before, before),
            *zip(before, after),
            *zip(whole_after, after),
        ]:
            assert a == pytest.approx(b, abs=1e-5)


def test_lora_adapter_export_under_zero3(judge_dir: str, rank_env: None) -> None:
    """model.lora.sync=adapter under ZeRO-3: the rank gathers the adapter's partitions for the
    copy (`WeightSender.adapter`), so the message holds full tensors, and an HF engine that loads
    it serves the learner's merged weights bit for bit (the learner's checksums gather too)."""
    from pjray.config import LoraConfig

    model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=3, micro_batch_size=2)
    model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, alpha=8.0))
    rank = LearnerRank(
        model_cfg,
        learner_cfg,
        algo_cfg,
        judge_dir,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_address()[1],
        total_steps=10,
        grad_accum_steps=1,
    )
    try:
        module = rank.policy.engine.module
        adapters = {n: p for n, p in module.named_parameters() if ".lora_B" in n}
        assert all(p.numel() == 0 for p in adapters.values())  # partitioned outside a gather
        with rank.policy.ds.zero.GatheredParameters(list(adapters.values()), modifier_rank=0):
            generator = torch.Generator().manual_seed(0)
            for p in adapters.values():
                p.data.copy_(torch.randn(p.shape, generator=generator) * 0.1)  # as after training
        update = rank.adapter()
        learner_sums = rank.checksums()
    finally:
        rank.shutdown()
    assert update is not None and update.rank == 4
    b_tensors = {n: t for n, t in update.tensors.items() if ".lora_B." in n}
    assert len(b_tensors) == len(adapters) and all(t.numel() and t.abs().sum() > 0 for t in b_tensors.values())
    assert all(t.numel() for t in update.tensors.values())
    engine = HFEngine(judge_dir, ModelConfig(), RolloutConfig(backend="hf"))
    base_sums = engine.checksums()
    engine.load_adapter(update)
    assert engine.checksums() == learner_sums != base_sums


def test_lora_under_zero3_trains_as_under_zero2(judge_dir: str, rank_env: None) -> None:
    """LoRA's frozen output projection under ZeRO-3 is a partition outside its forward: the
    chunked projection's recomputation in backward must still see the full weight (it failed
    with a checkpoint metadata error before). The step equals ZeRO-2's."""
    from pjray.config import LoraConfig

    exps = _experiences(4, seed=9)
    metrics = []
    for stage in (2, 3):
        model_cfg, learner_cfg, algo_cfg = _configs(zero_stage=stage, micro_batch_size=2)
        model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, alpha=8.0))
        overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else None
        torch.manual_seed(0)  # the same random A matrices in both
        rank = LearnerRank(
            model_cfg,
            learner_cfg,
            algo_cfg,
            judge_dir,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_address()[1],
            total_steps=10,
            grad_accum_steps=2,
            ds_config_overrides=overrides,
        )
        try:
            metrics.append([rank.train_step(exps, *_counts(exps)) for _ in range(2)])
        finally:
            rank.shutdown()
    for zero2, zero3 in zip(*metrics):
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy"):
            assert zero3[key] == pytest.approx(zero2[key], rel=1e-4, abs=1e-7), key
    assert metrics[0][1]["actor/grad_norm"] > 0
