"""GRPO math as pure tensor functions: advantages, the clipped policy loss, k3 KL, aggregation.

Definitions follow verl (`core_algos.py`), which the paper trained with:

* advantage: per-group z-score of the outcome reward, unbiased std, eps 1e-6 (Dr.GRPO: mean only);
* ratio exp(clamp(logp - old_logp, +-20)), PPO clip [1 - clip_low, 1 + clip_high], dual clip c
  for negative advantages;
* KL to the reference as a loss term, k3 / "low_var_kl", clamped to [-10, 10];
* loss aggregation "token-mean" (default), "seq-mean-token-mean", "seq-mean-token-sum-norm";
* GSPO (`LossSettings(kind="gspo")`): the length-normalised sequence ratio
  exp(mean_t(logp - old_logp)), clipped per sequence, with the token-level gradient of the GSPO
  paper (arXiv 2507.18071, GSPO-token with all token advantages equal to the sequence's);
* rollout correction (`rollout_is_weights`): importance weights old-policy / rollout-engine per
  token or sequence, truncated above (TIS) or masked outside a band (IcePop), multiplying the
  per-token policy loss (verl's `rollout_is`).

Deliberate differences from verl, both small and documented where they occur:

* a group of size 1 gets advantage 0 (verl uses mean 0, std 1 there, i.e. the raw reward);
* "seq-mean-token-sum-norm" divides by the sequence count as well as by `norm_len`, so it is a
  mean over sequences as its name (and Dr.GRPO's 1/G) says; verl sums over sequences.

Shapes: N = rewards in a batch, G = groups, B = sequences, T = padded length, V = vocabulary.
Nothing here imports Ray or DeepSpeed; the learner calls these inside its micro-batch loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pjray.config import AlgoConfig

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Rows of logits processed at once by token_logprobs / entropy_from_logits: bounds the float32
# temporaries to chunk x V instead of B x T x V.
_LOGIT_CHUNK_ROWS = 1024


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """[N] -> [G, group_size] float view; raises on a ragged layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            f"({rewards.numel()} % {group_size} = {rewards.numel() % group_size})"
        )
    values = rewards if rewards.is_floating_point() else rewards.float()
    return values.reshape(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage of each response.

    Args:
        rewards: [N] outcome rewards laid out group by group: rewards[g * group_size + j] is
            sample j of prompt g (N = G * group_size).
        group_size: responses per prompt.
        norm_by_std: (r - mean) / (std + eps) with the unbiased group std (GRPO); when False,
            only the mean is subtracted (Dr.GRPO).
        eps: added to the std so a zero-variance group gives 0, not nan.

    Returns:
        [N] advantages (float). A group of size 1 has no baseline to compare with, so its
        advantage is 0 (verl would return r / (1 + eps) there).
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        # correction=1: the unbiased estimator, as torch.std's default and verl use.
        centred = centred / (grouped.std(dim=1, keepdim=True, correction=1) + eps)
    return centred.reshape(-1)


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which groups carry no learning signal because all their rewards are equal.

    Args:
        rewards: [N] laid out group by group, as in `group_advantages`.

    Returns:
        [G] bool, True where every reward of the group is identical (always True for size 1).
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


# ---------------------------------------------------------------------------------------------
# Per-token quantities
# ---------------------------------------------------------------------------------------------


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 ("low_var_kl") estimate of KL(pi || pi_ref) per token; same shape as the inputs.

    delta = clamp(ref_logp - logp, -20, 20); kl = exp(delta) - delta - 1, clamped to [-10, 10].
    It is non-negative and unbiased for samples from pi; the clamps keep one wild token from
    producing inf or dominating the batch.
    """
    delta = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(delta) - delta - 1.0, min=-10.0, max=10.0)


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log pi(labels[:, t] | ...) read from logits[:, t].

    Alignment: logits[:, t] is the distribution that predicts labels[:, t]; the caller shifts
    (labels = input_ids[:, 1:], logits = model_logits[:, :-1]).

    Args:
        logits: [B, T, V] (any float dtype).
        labels: [B, T] long; negative ids (e.g. -100 padding) give 0.

    Returns:
        [B, T] float32. Computed as logit[label] - logsumexp(logits) over chunks of rows in
        float32, so the full [B, T, V] log_softmax is never materialised and bf16 logits do not
        lose precision in the normaliser.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    valid = flat_labels >= 0
    safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    pieces = []
    for start in range(0, flat_logits.shape[0], _LOGIT_CHUNK_ROWS):
        chunk = flat_logits[start : start + _LOGIT_CHUNK_ROWS].float()
        picked = chunk.gather(-1, safe_labels[start : start + _LOGIT_CHUNK_ROWS, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return torch.where(valid, out, torch.zeros_like(out)).reshape(labels.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position.

    Args:
        logits: [B, T, V] (any leading shape works).

    Returns:
        [B, T] float32: H = logsumexp(x) - sum(softmax(x) * x), which never takes log(0).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], _LOGIT_CHUNK_ROWS):
        chunk = flat[start : start + _LOGIT_CHUNK_ROWS].float()
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce per-token values to one scalar: this micro-batch's share of the batch loss.

    Args:
        values: [B, T] per-token values (loss, KL, ...).
        mask: [B, T] 1 on tokens that count (bool, int or float).
        mode: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum-norm".
        global_tokens: masked tokens in the whole optimizer step (all DP ranks, all
            micro-batches); used by "token-mean".
        global_seqs: sequences with at least one masked token in the whole optimizer step;
            used by the two "seq-mean" modes. Fully masked rows count for nothing anywhere.
        dp_size: data-parallel world size; only used together with a global count.
        norm_len: the constant length of "seq-mean-token-sum-norm" (Dr.GRPO), normally the
            configured max response length; when None, the padded T of this tensor (as verl),
            which is split-invariant only if every micro-batch is padded to the same T.

    Returns:
        [] scalar. With global counts, each micro-batch on each rank returns

            token-mean:               sum(v * m)                      / global_tokens * dp_size
            seq-mean-token-mean:      sum_i (sum_t v*m / sum_t m)     / global_seqs   * dp_size
            seq-mean-token-sum-norm:  sum_i (sum_t v*m) / norm_len    / global_seqs   * dp_size

        so SUMMING over a rank's micro-batches (gradient accumulation without averaging) and
        AVERAGING over ranks (DeepSpeed's all-reduce mean) gives exactly the full-batch value.
        Without the count a mode needs (and dp_size == 1), the plain value of this tensor alone
        is returned: the same formulas with the local count.

    Raises:
        ValueError: unknown mode, or dp_size > 1 without the global count the mode needs
        (local counts would silently weight ranks unequally).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    m = mask.to(values.dtype)
    token_sum_per_seq = (values * m).sum(dim=-1)  # [B]

    if mode == "token-mean":
        total, count = token_sum_per_seq.sum(), global_tokens
        count_name = "global_tokens"
        local_count = m.sum()
    else:
        tokens_per_seq = m.sum(dim=-1)  # [B]
        if mode == "seq-mean-token-mean":
            # Fully masked rows have a zero numerator; clamp keeps them at 0 instead of nan.
            per_seq = token_sum_per_seq / tokens_per_seq.clamp(min=1.0)
        else:
            length = float(values.shape[-1]) if norm_len is None else float(norm_len)
            if length <= 0:
                raise ValueError(f"norm_len must be > 0, got {norm_len}")
            per_seq = token_sum_per_seq / length
        total, count = per_seq.sum(), global_seqs
        count_name = "global_seqs"
        local_count = (tokens_per_seq > 0).to(values.dtype).sum()

    if count is None:
        if dp_size != 1:
            raise ValueError(f"aggregate mode {mode!r} with dp_size={dp_size} needs {count_name}")
        # An all-masked micro-batch has total 0; clamp returns 0 with a gradient, not nan.
        return total / local_count.clamp(min=1.0)
    if count <= 0:
        # The whole step has nothing to train on: contribute an exact zero that still backprops.
        return total * 0.0
    return total / float(count) * dp_size


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def _masked_mean_item(values: Tensor, mask: Tensor) -> float:
    """Python float mean of values over mask (0.0 when the mask is empty); for metrics only."""
    m = mask.to(values.dtype)
    count = m.sum()
    return float((values * m).sum() / count.clamp(min=1.0))


POLICY_LOSSES = ("grpo", "gspo")
IS_LEVELS = ("token", "sequence")
# Log-ratios are clamped here before exp (verl's SAFETY_BOUND): exp(20) ~ 5e8 stays finite.
LOG_RATIO_BOUND = 20.0


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-token log importance ratio: the sequence's length-normalised log-ratio
    mean_t(logp - old_logp) as its value on every token (detached), plus logp - sg(logp), whose
    value is 0 and whose gradient is the token's own: so d ratio / d logp_t = ratio on each token,
    and a sequence-mean of the tokens' losses has the GSPO paper's gradient
    s_i * (1/|y_i|) sum_t grad log pi(y_t)."""
    m = mask.to(logp.dtype)
    per_seq = ((logp.detach() - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return logp - logp.detach() + per_seq.unsqueeze(-1)


@dataclass(frozen=True)
class LossSettings:
    """How a run's GRPO loss is computed, fixed for the run (`AlgoConfig`, `from_algo`): one
    object for `policy_loss` and `grpo_loss`, so the two cannot disagree.

    kind: "grpo" (per-token ratio exp(logp - old_logp)) or "gspo" (`sequence_log_ratio`: one
        length-normalised ratio a sequence, clipped per sequence; no dual clip, and the paper's
        clip ranges are ~1e-3 where GRPO's are 0.2).
    clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
    dual_clip: c > 1; for A < 0 the loss is capped at -A * c so a huge ratio on a bad token
        cannot blow up the step. None disables it.
    agg, norm_len: the mode and constant length of `aggregate`.
    kl_coef: weight of the KL term of `grpo_loss` (the policy loss has none).
    """

    kind: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    agg: str = "token-mean"
    norm_len: float | None = None
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {self.kind!r}; expected one of {POLICY_LOSSES}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")

    @classmethod
    def from_algo(cls, algo: AlgoConfig, norm_len: float | None = None) -> LossSettings:
        """The settings `algo` names (its dual_clip 0 is off); `norm_len` as in `aggregate`."""
        return cls(
            kind=algo.policy_loss,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip if algo.dual_clip > 0 else None,
            agg=algo.loss_agg,
            norm_len=norm_len,
            kl_coef=algo.kl_coef,
        )


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings = LossSettings(),
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (verl "vanilla" policy loss), or GSPO's.

    Args:
        logp: [B, T] log-probs of the sampled tokens under the policy being trained (grad).
        old_logp: [B, T] log-probs under the policy that sampled them.
        advantages: [B, T] per token, or [B] per sequence (broadcast over T).
        mask: [B, T] 1 on response tokens that are trained on.
        settings: the variant, clip ranges and aggregation (`LossSettings`; kl_coef unused).
        global_tokens, global_seqs, dp_size: this micro-batch's place in the step, passed to
            `aggregate`.
        is_weights: [B, T] rollout-correction weights (`rollout_is_weights`, detached) that
            multiply the per-token loss; None: no correction.

    Returns:
        (loss [] scalar as from `aggregate`, metrics) with masked token means as floats:
        pg_clipfrac (PPO clip active), pg_clipfrac_lower (dual clip active), ppo_kl
        (mean of old_logp - logp), ratio_mean.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logp)

    raw_log_ratio = logp - old_logp if settings.kind == "grpo" else sequence_log_ratio(logp, old_logp, mask)
    log_ratio = torch.clamp(raw_log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    if settings.dual_clip is not None and settings.kind == "grpo":
        loss_cap = -advantages * settings.dual_clip
        per_token = torch.where(advantages < 0, torch.minimum(loss_ppo, loss_cap), loss_ppo)
    else:
        loss_cap = None
        per_token = loss_ppo
    if is_weights is not None:
        per_token = per_token * is_weights

    loss = aggregate(per_token, mask, settings.agg, global_tokens, global_seqs, dp_size, settings.norm_len)

    with torch.no_grad():
        if loss_cap is not None:
            lower = ((loss_ppo > loss_cap) & (advantages < 0)).float()
        else:
            lower = torch.zeros_like(ratio)
        metrics = {
            "pg_clipfrac": _masked_mean_item((loss_clipped > loss_unclipped).float(), mask),
            "pg_clipfrac_lower": _masked_mean_item(lower, mask),
            "ppo_kl": _masked_mean_item(-torch.clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), mask),
            "ratio_mean": _masked_mean_item(ratio, mask),
        }
    return loss, metrics


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings = LossSettings(),
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: clipped policy loss + kl_coef * aggregate(k3 KL to the reference).

    KL is a loss term (verl `use_kl_loss`), aggregated with the same mode and counts as the
    policy loss, so the sum is split-invariant too. The rollout-correction weights multiply the
    policy loss only.

    Args:
        ref_logp: [B, T] reference-model log-probs; may be None only when settings.kl_coef == 0.
        the others: as in `policy_loss`.

    Returns:
        (loss [] scalar, metrics): `policy_loss` metrics plus pg_loss and kl_loss, this
        micro-batch's contributions (sum over micro-batches, mean over ranks = full value).
    """
    pg, metrics = policy_loss(
        logp, old_logp, advantages, mask, settings, global_tokens, global_seqs, dp_size, is_weights
    )
    if ref_logp is None:
        if settings.kl_coef != 0:
            raise ValueError(f"kl_coef={settings.kl_coef} needs ref_logp; pass it or set kl_coef=0")
        kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    else:
        kl = aggregate(
            kl_k3(logp, ref_logp), mask, settings.agg, global_tokens, global_seqs, dp_size, settings.norm_len
        )
    loss = pg + settings.kl_coef * kl
    metrics["pg_loss"] = float(pg.detach())
    metrics["kl_loss"] = float(kl.detach())
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Rollout correction: the engine that sampled is not the learner
# ---------------------------------------------------------------------------------------------

# Sums over the units a level weighs (tokens or sequences), added up over micro-batches and ranks
# and turned into metrics by `rollout_is_metrics`: [units, sum w, sum w^2, units outside the bound].
IS_SUMS = 4


def rollout_is_weights(
    log_ratio: Tensor, mask: Tensor, level: str, upper: float, lower: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Importance weights for samples drawn by a rollout engine and trained by the learner.

    Args:
        log_ratio: [B, T] old-policy minus rollout-engine log-probs of each sampled token (0
            where the engine gave none).
        mask: [B, T] 1 on response tokens that are trained on.
        level: "token": w_t = exp(log_ratio_t); "sequence": one weight a sequence,
            exp(sum_t log_ratio_t) (the product of its tokens' ratios), on each of its tokens.
        upper: with `lower` None, TIS: weights above `upper` are set to `upper`.
        lower: IcePop: weights outside [lower, upper] are set to 0 (those tokens, or sequences,
            drop out of the policy loss).

    Log-ratios are clamped to +-20 before exp. Padding gets weight 0; the weights are detached.

    Returns:
        (weights [B, T], sums [IS_SUMS] of the final weights over the units of `level`: units,
        sum w, sum w^2, units whose raw weight was truncated or masked; max raw weight [] over
        the units). `rollout_is_metrics` turns sums and max into metrics.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; expected one of {IS_LEVELS}")
    if upper <= 0 or (lower is not None and not 0 <= lower < upper):
        raise ValueError(f"rollout_is bounds: need 0 <= lower < upper and upper > 0, got lower={lower}, upper={upper}")
    with torch.no_grad():
        m = mask.to(log_ratio.dtype)
        if level == "token":
            raw = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [B, T]
            units = m > 0
        else:
            raw = torch.exp(torch.clamp((log_ratio * m).sum(-1), -LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [B]
            units = (m > 0).any(-1)
        if lower is None:
            outside = raw > upper
            bounded = torch.clamp(raw, max=upper)
        else:
            outside = (raw < lower) | (raw > upper)
            bounded = torch.where(outside, torch.zeros_like(raw), raw)
        weights = (bounded if level == "token" else bounded.unsqueeze(-1).expand_as(log_ratio)) * m
        kept = bounded[units].to(torch.float64)
        sums = torch.stack(
            [
                units.sum().to(torch.float64),
                kept.sum(),
                (kept * kept).sum(),
                outside[units].sum().to(torch.float64),
            ]
        )
        raw_max = raw[units].max().to(torch.float64) if units.any() else torch.zeros((), dtype=torch.float64)
    return weights.detach(), sums, raw_max


def rollout_is_metrics(sums: Tensor, raw_max: float) -> dict[str, float]:
    """rollout_is/*: the weights' mean and the effective sample size (sum w)^2 / (n sum w^2)
    (1: all weights equal; near 0: a few units carry the step), the largest raw weight, the
    fraction of units truncated (TIS) or masked (IcePop); the units are tokens or sequences, as
    `rollout_is_weights` counted them."""
    units, total, squares, outside = (float(x) for x in sums)
    if units == 0:
        return {}
    return {
        "rollout_is/mean": total / units,
        "rollout_is/max": float(raw_max),
        "rollout_is/frac_clipped": outside / units,
        "rollout_is/ess": total * total / (units * squares) if squares > 0 else 0.0,
        "rollout_is/units": units,
    }


# ---------------------------------------------------------------------------------------------
# Supervised fine-tuning (the warm start before GRPO)
# ---------------------------------------------------------------------------------------------


def sft_loss(logp: Tensor, mask: Tensor, global_tokens: float, dp_size: int = 1) -> Tensor:
    """Negative log-likelihood of the target tokens, a token mean over the WHOLE batch.

    Args:
        logp: [B, T] log-prob of each target token (`token_logprobs`).
        mask: [B, T] 1 on target (response) tokens, 0 on prompt and padding.
        global_tokens: target tokens in the full batch over all data-parallel ranks.
        dp_size: data-parallel ranks; gradients are averaged over ranks, so each rank's sum is
            scaled by dp_size to make the average equal the full-batch token mean.

    Returns: scalar; summed over a rank's micro-batches and averaged over ranks it equals
    -sum(logp * mask) / global_tokens of the full batch, however the batch was split.
    """
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be > 0, got {global_tokens}")
    return -(logp * mask).sum() * dp_size / global_tokens
