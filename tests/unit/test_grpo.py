"""GRPO math against hand-computed numbers, plus split-invariance properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.rl import grpo
from pjray.rl.grpo import (
    AGG_MODES,
    LossSettings,
    aggregate,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    kl_k3,
    policy_loss,
    token_logprobs,
    zero_std_groups,
)

E05 = math.exp(0.5)  # ratio when logp - old_logp = 0.5
EM05 = math.exp(-0.5)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# --------------------------------------------------------------------------------- advantages


def test_group_advantages_zscore_unbiased_std():
    # Each group is {1, 0}: mean 0.5, unbiased std sqrt(0.5) = 0.7071...
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    out = group_advantages(t([1.0, 0.0, 0.0, 1.0]), group_size=2)
    torch.testing.assert_close(out, t([a, -a, -a, a]), rtol=0, atol=1e-12)
    assert out[0].item() == pytest.approx(0.7071057, abs=1e-7)


def test_group_advantages_group_of_three():
    # {1, 2, 3}: mean 2, unbiased std 1.
    out = group_advantages(t([1.0, 2.0, 3.0]), group_size=3)
    torch.testing.assert_close(out, t([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)]), rtol=0, atol=1e-12)


def test_dr_grpo_only_subtracts_the_mean():
    out = group_advantages(t([1.0, 2.0, 3.0, 0.0, 0.0, 6.0]), group_size=3, norm_by_std=False)
    torch.testing.assert_close(out, t([-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]), rtol=0, atol=1e-12)


def test_zero_variance_group_gives_zero_not_nan():
    out = group_advantages(t([0.5, 0.5, 1.0, 0.0]), group_size=2)
    assert out[:2].tolist() == [0.0, 0.0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_size_one_groups_have_zero_advantage(norm_by_std):
    out = group_advantages(t([0.3, 1.0, -2.0]), group_size=1, norm_by_std=norm_by_std)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_accepts_integer_rewards():
    out = group_advantages(torch.tensor([1, 0]), group_size=2)
    assert out.dtype == torch.float32
    assert out[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)


def test_ragged_groups_raise():
    with pytest.raises(ValueError, match="groups of 2"):
        group_advantages(t([1.0, 0.0, 1.0]), group_size=2)
    with pytest.raises(ValueError, match="groups of 2"):
        zero_std_groups(t([1.0, 0.0, 1.0]), group_size=2)


def test_zero_std_groups():
    rewards = t([1.0, 1.0, 0.0, 1.0, 0.3, 0.3])
    assert zero_std_groups(rewards, 2).tolist() == [True, False, True]
    assert zero_std_groups(rewards, 3).tolist() == [False, False]
    assert zero_std_groups(rewards, 1).tolist() == [True] * 6


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    group_size=st.integers(1, 8),
    groups=st.integers(1, 6),
    norm_by_std=st.booleans(),
)
def test_advantages_have_zero_group_mean(data, group_size, groups, norm_by_std):
    rewards = data.draw(
        st.lists(
            st.floats(-10, 10, allow_nan=False),
            min_size=group_size * groups,
            max_size=group_size * groups,
        )
    )
    r = t(rewards)
    adv = group_advantages(r, group_size, norm_by_std=norm_by_std).reshape(groups, group_size)
    zeros = torch.zeros(groups, dtype=r.dtype)
    torch.testing.assert_close(adv.mean(dim=1), zeros, rtol=0, atol=1e-9)
    if norm_by_std and group_size > 1:
        std = r.reshape(groups, group_size).std(dim=1)
        spread = std > 1e-2
        # Where the group really varies, the normalised advantages have unit std (up to eps).
        torch.testing.assert_close(adv.std(dim=1)[spread], torch.ones_like(std[spread]), rtol=0, atol=1e-3)


# ------------------------------------------------------------------------------------- k3 KL


def test_kl_k3_known_values():
    log2 = math.log(2.0)
    logp = t([0.0, log2, -1.0, 0.0, 0.0])
    ref = t([log2, 0.0, -1.0, 30.0, -30.0])
    out = kl_k3(logp, ref)
    expected = [
        2.0 - log2 - 1.0,  # delta = log 2
        0.5 + log2 - 1.0,  # delta = -log 2
        0.0,  # same distribution
        10.0,  # delta clamped to 20, exp(20) - 21 clamped to 10
        10.0,  # delta clamped to -20: exp(-20) + 19 clamped to 10
    ]
    torch.testing.assert_close(out, t(expected), rtol=0, atol=1e-12)


def test_kl_k3_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(100, generator=g) * 5, torch.randn(100, generator=g) * 5
    assert (kl_k3(logp, ref) >= 0).all()


# --------------------------------------------------------------------------------- aggregate

VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 7.0, 7.0]]
MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]  # the third row is fully masked and counts for nothing


def test_aggregate_local_values():
    v, m = t(VALUES), torch.tensor(MASK)
    assert aggregate(v, m, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 9 / 2) / 2)
    # norm_len defaults to the padded length T = 3.
    assert aggregate(v, m, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 9 / 3) / 2)
    assert aggregate(v, m, "seq-mean-token-sum-norm", norm_len=5).item() == pytest.approx(1.5)


def test_aggregate_with_global_counts():
    v, m = t(VALUES), torch.tensor(MASK)
    # This rank holds 5 of 10 tokens (2 of 4 sequences) in a 2-rank step.
    assert aggregate(v, m, "token-mean", global_tokens=10, dp_size=2).item() == pytest.approx(15 / 10 * 2)
    assert aggregate(v, m, "seq-mean-token-mean", global_seqs=4, dp_size=2).item() == pytest.approx((2 + 4.5) / 4 * 2)
    out = aggregate(v, m, "seq-mean-token-sum-norm", global_seqs=4, dp_size=2, norm_len=5)
    assert out.item() == pytest.approx((6 + 9) / 5 / 4 * 2)


def test_aggregate_empty_mask_is_zero_with_gradient():
    v = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    m = torch.zeros(2, 3)
    for mode in AGG_MODES:
        out = aggregate(v, m, mode)
        assert out.item() == 0.0
        out.backward()
        assert v.grad is not None and (v.grad == 0).all()
        v.grad = None
    assert aggregate(v, m, "token-mean", global_tokens=0).item() == 0.0


def test_aggregate_errors():
    v, m = t(VALUES), torch.tensor(MASK)
    with pytest.raises(ValueError, match="'seq-sum'"):
        aggregate(v, m, "seq-sum")
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(v, m, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_seqs"):
        aggregate(v, m, "seq-mean-token-mean", global_tokens=5, dp_size=2)
    with pytest.raises(ValueError, match="differ"):
        aggregate(v, m[:, :2], "token-mean")


def _split(values, mask, owner_rank, owner_micro, dp, n_micro):
    """Rows of (values, mask) for each (rank, micro-batch), each trimmed to its own padding."""
    parts = {}
    for r in range(dp):
        for k in range(n_micro):
            rows = [i for i in range(values.shape[0]) if owner_rank[i] == r and owner_micro[i] == k]
            v, m = values[rows], mask[rows]
            # Micro-batches are padded to their own longest response, so T differs between them.
            used = int(m.sum(dim=0).nonzero().max()) + 1 if m.sum() > 0 else 1
            parts[(r, k)] = (v[:, :used], m[:, :used])
    return parts


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 10),
    cols=st.integers(1, 6),
    dp=st.sampled_from([1, 2, 4]),
    n_micro=st.integers(1, 3),
    mode=st.sampled_from(AGG_MODES),
    seed=st.integers(0, 2**31 - 1),
)
def test_aggregation_is_split_invariant(data, rows, cols, dp, n_micro, mode, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=g) < 0.7).long()
    owner_rank = data.draw(st.lists(st.integers(0, dp - 1), min_size=rows, max_size=rows))
    owner_micro = data.draw(st.lists(st.integers(0, n_micro - 1), min_size=rows, max_size=rows))
    norm_len = float(cols + 2)  # a config constant, independent of each micro-batch's padding

    full = aggregate(values, mask, mode, norm_len=norm_len)
    global_tokens = float(mask.sum())
    global_seqs = float((mask.sum(dim=-1) > 0).sum())

    parts = _split(values, mask, owner_rank, owner_micro, dp, n_micro)
    per_rank = [
        sum(
            aggregate(v, m, mode, global_tokens, global_seqs, dp_size=dp, norm_len=norm_len)
            for (rank, _), (v, m) in parts.items()
            if rank == r
        )
        for r in range(dp)
    ]
    combined = sum(per_rank) / dp  # DeepSpeed: accumulate micro-batches, all-reduce mean
    assert float(combined) == pytest.approx(float(full), rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------- policy loss


def _one_token(delta, adv, **kwargs):
    logp = t([[delta]])
    old = t([[0.0]])
    return policy_loss(logp, old, t([[adv]]), torch.ones(1, 1), LossSettings(**kwargs))


@pytest.mark.parametrize(
    "delta, adv, loss, clipped",
    [
        (0.5, 1.0, -1.2, 1.0),  # ratio e^0.5 > 1.2, A > 0: clipped at 1.2 -> -1.2
        (0.5, -1.0, E05, 0.0),  # A < 0: max(e^0.5, 1.2) -> the unclipped e^0.5 (< 3, no dual)
        (-0.5, 1.0, -EM05, 0.0),  # ratio e^-0.5 < 0.8, A > 0: max(-0.607, -0.8) = -0.607
        (-0.5, -1.0, 0.8, 1.0),  # A < 0: max(0.607, 0.8) = 0.8, clipped
        (0.0, 1.0, -1.0, 0.0),  # ratio 1
    ],
)
def test_policy_loss_clip_cases(delta, adv, loss, clipped):
    out, metrics = _one_token(delta, adv)
    assert out.item() == pytest.approx(loss, abs=1e-12)
    assert metrics["pg_clipfrac"] == clipped
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-delta)
    assert metrics["ratio_mean"] == pytest.approx(math.exp(delta))


def test_dual_clip_caps_negative_advantage_loss():
    out, metrics = _one_token(math.log(5.0), -1.0)  # ratio 5, A = -1: PPO loss 5, capped at 3
    assert out.item() == pytest.approx(3.0)
    assert metrics["pg_clipfrac_lower"] == 1.0
    assert metrics["pg_clipfrac"] == 0.0  # max(5, 1.2) picks the unclipped term
    out, metrics = _one_token(math.log(5.0), -1.0, dual_clip=None)
    assert out.item() == pytest.approx(5.0)
    assert metrics["pg_clipfrac_lower"] == 0.0
    out, _ = _one_token(math.log(5.0), -1.0, dual_clip=2.0)
    assert out.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="dual_clip"):
        _one_token(0.0, 1.0, dual_clip=1.0)


def test_dual_clip_does_not_touch_positive_advantages():
    out, metrics = _one_token(math.log(5.0), 1.0)  # A > 0: min(-5, -1.2) region -> -1.2
    assert out.item() == pytest.approx(-1.2)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_asymmetric_clip():
    out, _ = _one_token(0.5, 1.0, clip_high=0.28)
    assert out.item() == pytest.approx(-1.28)
    out, _ = _one_token(-0.5, -1.0, clip_low=0.1)
    assert out.item() == pytest.approx(0.9)


def test_policy_loss_batch_means_and_mask():
    logp = t([[0.5, 0.5, -0.5, -0.5, 9.0]])
    old = torch.zeros_like(logp)
    adv = t([[1.0, -1.0, 1.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding and must not count
    out, metrics = policy_loss(logp, old, adv, mask)
    assert out.item() == pytest.approx((-1.2 + E05 - EM05 + 0.8) / 4)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx(math.cosh(0.5))
    assert all(isinstance(x, float) for x in metrics.values())


def test_per_sequence_advantages_broadcast():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 4, generator=g) < 0.8).long()
    adv = t([1.0, -0.5, 2.0])
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv[:, None].expand(3, 4), mask)
    assert a.item() == pytest.approx(b.item())
    assert ma == mb


def test_ratio_log_is_clamped():
    out, metrics = _one_token(50.0, 1.0, dual_clip=None, clip_high=1e9)
    assert math.isfinite(out.item())
    assert metrics["ratio_mean"] == pytest.approx(math.exp(20.0))


# --------------------------------------------------------------------------------- grpo loss


def test_grpo_loss_adds_kl_term():
    log2 = math.log(2.0)
    logp = t([[0.0, 0.0]])
    old = t([[0.0, 0.0]])
    ref = t([[log2, 0.0]])  # k3 = [1 - log 2, 0]
    adv = t([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, metrics = grpo_loss(logp, old, ref, adv, mask, LossSettings(kl_coef=0.1))
    kl = (1.0 - log2) / 2
    assert metrics["pg_loss"] == pytest.approx(-1.0)
    assert metrics["kl_loss"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * kl)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean"):
        assert key in metrics


def test_grpo_loss_without_reference():
    logp, adv, mask = t([[0.0]]), t([[1.0]]), torch.ones(1, 1)
    loss, metrics = grpo_loss(logp, logp, None, adv, mask, LossSettings(kl_coef=0.0))
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["kl_loss"] == 0.0
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp, None, adv, mask, LossSettings(kl_coef=0.01))


def test_loss_settings_from_the_algo_config():
    """The settings the learner builds from `algo`: its names, a dual clip of 0 is none, and
    impossible settings fail when built, not at the first loss."""
    from pjray.config import AlgoConfig

    algo = AlgoConfig(
        policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4, dual_clip=0.0, kl_coef=0.02
    )
    assert LossSettings.from_algo(algo, norm_len=64) == LossSettings(
        kind="gspo", clip_low=3e-4, clip_high=4e-4, dual_clip=None, agg="seq-mean-token-mean", norm_len=64, kl_coef=0.02
    )
    assert LossSettings.from_algo(AlgoConfig()).dual_clip == 3.0
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        LossSettings(kind="ppo")
    with pytest.raises(ValueError, match="dual_clip"):
        LossSettings(dual_clip=1.0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dp=st.sampled_from([2, 4]),
    mode=st.sampled_from(AGG_MODES),
)
def test_grpo_gradient_is_split_invariant(seed, dp, mode):
    """Gradients accumulated over ranks x micro-batches equal the full-batch gradient."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 8, 5
    logp = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=g) < 0.7).long()
    cfg = LossSettings(kl_coef=0.05, agg=mode, norm_len=7.0)

    full, _ = grpo_loss(logp, old, ref, adv, mask, cfg)
    (full_grad,) = torch.autograd.grad(full, logp)

    global_tokens = float(mask.sum())
    global_seqs = float((mask.sum(dim=-1) > 0).sum())
    grad = torch.zeros_like(logp)
    per_rank = rows // dp
    for r in range(dp):
        rank_rows = list(range(r * per_rank, (r + 1) * per_rank))
        rank_grad = torch.zeros_like(logp)
        for micro in (rank_rows[: per_rank // 2], rank_rows[per_rank // 2 :]):
            if not micro:
                continue
            part, _ = grpo_loss(
                logp[micro],
                old[micro],
                ref[micro],
                adv[micro],
                mask[micro],
                cfg,
                global_tokens=global_tokens,
                global_seqs=global_seqs,
                dp_size=dp,
            )
            (gr,) = torch.autograd.grad(part, logp)
            rank_grad += gr  # gradient accumulation sums micro-batches
        grad += rank_grad / dp  # all-reduce mean over ranks
    torch.testing.assert_close(grad, full_grad, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ logprobs and entropy


def test_token_logprobs_hand_values():
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # probs [1/4, 3/4]
    labels = torch.tensor([[1, 0]])
    out = token_logprobs(logits, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.25)]]))


def test_token_logprobs_matches_log_softmax_across_chunks(monkeypatch):
    monkeypatch.setattr(grpo, "_LOGIT_CHUNK_ROWS", 3)  # force several chunks for 2 x 5 rows
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 11, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[1, 4] = -100
    out = token_logprobs(logits, labels)
    safe = labels.clamp(min=0)
    ref = torch.log_softmax(logits, -1).gather(-1, safe[..., None]).squeeze(-1)
    ref = torch.where(labels >= 0, ref, torch.zeros_like(ref))
    torch.testing.assert_close(out, ref)
    assert out[1, 4].item() == 0.0
    (gr,) = torch.autograd.grad(out.sum(), logits)
    (gr_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(gr, gr_ref)


def test_token_logprobs_bf16_keeps_float32_precision():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 1000, generator=g) * 5).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (2, 3), generator=g)
    out = token_logprobs(logits, labels)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)


def test_token_logprobs_shape_mismatch():
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_hand_values_and_stability():
    v = 8
    uniform = torch.zeros(1, 2, v)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((1, 2), math.log(v)))
    two = t([[[0.0, math.log(3.0)]]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(h, rel=1e-6)
    spiky = torch.tensor([[[1e4, 0.0, -1e4]]])
    out = entropy_from_logits(spiky)
    assert torch.isfinite(out).all() and out.item() == pytest.approx(0.0, abs=1e-6)


def test_sft_loss_is_the_full_batch_token_mean_however_split():
    from pjray.rl.grpo import sft_loss

    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # Hand computed: (2 + 3 + 0.5) / 3 target tokens.
    assert sft_loss(logp, mask, global_tokens=3.0).item() == pytest.approx(5.5 / 3)
    # Two ranks, one row each: the average of the per-rank losses equals the full-batch mean.
    ranks = [sft_loss(logp[i : i + 1], mask[i : i + 1], global_tokens=3.0, dp_size=2) for i in range(2)]
    assert (sum(ranks) / 2).item() == pytest.approx(5.5 / 3)
    with pytest.raises(ValueError, match="global_tokens"):
        sft_loss(logp, mask, global_tokens=0.0)
