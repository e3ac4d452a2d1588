"""Rollout correction (TIS / IcePop, per token and per sequence) and GSPO against their formulas
on random inputs. The expected values are written from the definitions (verl's
`compute_rollout_correction_weights`, the GSPO paper, arXiv 2507.18071), not from pjray."""

from __future__ import annotations

import math

import pytest
import torch

from pjray.rl.grpo import LossSettings, aggregate, policy_loss, rollout_is_metrics, rollout_is_weights


def random_batch(seed: int, rows: int = 6, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-ratios around 0 (some far out) and a mask with padding and one empty row."""
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.6
    log_ratio[0, 0] = 40.0  # beyond the +-20 clamp
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    lengths[-1] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    return log_ratio, mask


def expected(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float | None):
    """Per-unit raw weight, final weight and whether it was cut, by plain loops."""
    rows, length = log_ratio.shape
    weights = torch.zeros_like(log_ratio)
    raws, finals, cut = [], [], []
    for i in range(rows):
        tokens = [t for t in range(length) if mask[i, t] > 0]
        if level == "token":
            units = [(math.exp(max(-20.0, min(20.0, float(log_ratio[i, t])))), [t]) for t in tokens]
        else:
            units = (
                [(math.exp(max(-20.0, min(20.0, sum(float(log_ratio[i, t]) for t in tokens)))), tokens)]
                if tokens
                else []
            )
        for raw, positions in units:
            if lower is None:
                final, outside = min(raw, upper), raw > upper
            else:
                outside = raw < lower or raw > upper
                final = 0.0 if outside else raw
            for t in positions:
                weights[i, t] = final
            raws.append(raw)
            finals.append(final)
            cut.append(outside)
    return weights, raws, finals, cut


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("upper, lower", [(2.0, None), (1.5, 0.5)])  # TIS, IcePop
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_and_their_metrics_follow_the_formulas(level, upper, lower, seed):
    log_ratio, mask = random_batch(seed)
    log_ratio.requires_grad_(True)
    weights, sums, raw_max = rollout_is_weights(log_ratio, mask, level, upper, lower)
    want, raws, finals, cut = expected(log_ratio.detach(), mask, level, upper, lower)
    assert torch.allclose(weights, want, rtol=1e-12, atol=0)
    assert not weights.requires_grad
    assert torch.all(weights[mask == 0] == 0)
    n = len(finals)
    metrics = rollout_is_metrics(sums, float(raw_max))
    assert metrics["rollout_is/units"] == n
    assert metrics["rollout_is/mean"] == pytest.approx(sum(finals) / n)
    assert metrics["rollout_is/max"] == pytest.approx(max(raws))
    assert metrics["rollout_is/frac_clipped"] == pytest.approx(sum(cut) / n)
    squares = sum(f * f for f in finals)
    assert metrics["rollout_is/ess"] == pytest.approx(sum(finals) ** 2 / (n * squares) if squares else 0.0)
    if level == "token":  # the log-ratio of 40 was clamped to 20 before exp
        assert metrics["rollout_is/max"] == pytest.approx(math.exp(20.0))


def test_equal_policies_give_weight_one_everywhere():
    log_ratio, mask = random_batch(3)
    for level in ("token", "sequence"):
        weights, sums, _ = rollout_is_weights(torch.zeros_like(log_ratio), mask, level, 2.0)
        assert torch.equal(weights, mask)
        metrics = rollout_is_metrics(sums, 1.0)
        assert metrics["rollout_is/ess"] == 1.0 and metrics["rollout_is/frac_clipped"] == 0.0


def test_bad_levels_and_bounds_are_refused():
    log_ratio, mask = random_batch(0)
    with pytest.raises(ValueError, match="unknown rollout_is level"):
        rollout_is_weights(log_ratio, mask, "geometric", 2.0)
    with pytest.raises(ValueError, match="lower < upper"):
        rollout_is_weights(log_ratio, mask, "token", 2.0, 3.0)
    assert rollout_is_metrics(torch.zeros(4, dtype=torch.float64), 0.0) == {}


def test_the_weights_multiply_the_per_token_policy_loss():
    gen = torch.Generator().manual_seed(5)
    logp = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.1 - 1.0
    old = logp + torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 7, dtype=torch.float64)
    mask[1, 5:] = 0
    weights = torch.rand(4, 7, generator=gen, dtype=torch.float64) * 2 * mask
    plain, _ = policy_loss(logp, old, adv, mask, LossSettings(dual_clip=None))
    weighted, _ = policy_loss(logp, old, adv, mask, LossSettings(dual_clip=None), is_weights=weights)
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
    assert weighted.item() == pytest.approx(float((per_token * weights).sum() / mask.sum()))
    assert plain.item() == pytest.approx(float((per_token * mask).sum() / mask.sum()))


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_the_papers_objective_and_gradient(seed):
    """J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i) with
    s_i = exp(1/|y_i| sum_t (log pi - log pi_old)); its gradient in log pi(y_{i,t}) is
    s_i A_i / (G |y_i|) where the unclipped branch is the minimum, and 0 where the clip binds."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = 8, 6
    old = torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.3 - 1.5
    logp = (old + torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.05).requires_grad_(True)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    eps_low, eps_high = 0.01, 0.02
    gspo = LossSettings(kind="gspo", clip_low=eps_low, clip_high=eps_high, dual_clip=3.0, agg="seq-mean-token-mean")
    loss, _ = policy_loss(logp, old, adv, mask, gspo)
    loss.backward()

    objective, grads = 0.0, torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows):
        n = int(lengths[i])
        s = math.exp(sum(float(logp[i, t].detach() - old[i, t]) for t in range(n)) / n)
        a = float(adv[i])
        unclipped, clipped = s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a
        objective += min(unclipped, clipped) / rows
        if unclipped <= clipped:  # the unclipped branch is the minimum: it carries the gradient
            grads[i, :n] = s * a / (rows * n)
    assert loss.item() == pytest.approx(-objective)
    assert torch.allclose(logp.grad, -grads, atol=1e-12)
    assert torch.all(logp.grad[mask == 0] == 0)


def test_gspo_and_grpo_agree_when_every_sequence_is_one_token():
    gen = torch.Generator().manual_seed(9)
    logp = torch.randn(5, 1, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(5, 1, generator=gen, dtype=torch.float64)
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mask = torch.ones(5, 1, dtype=torch.float64)
    grpo, _ = policy_loss(logp, old, adv, mask, LossSettings(dual_clip=None))
    gspo, _ = policy_loss(logp, old, adv, mask, LossSettings(kind="gspo", dual_clip=None))
    assert grpo.item() == pytest.approx(gspo.item())
    assert aggregate(torch.ones(5, 1), mask, "token-mean").item() == 1.0
