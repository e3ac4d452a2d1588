"""The learner's step statistics: named sums of micro-batches, reduced across ranks by name (sums
by sum, maxima by max), and the metrics they give."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pjray.rl.learner import StepSums


def _rank(scale: float) -> StepSums:
    return StepSums(
        pg_loss=0.5 * scale,
        kl_loss=0.1,
        tokens=10 * scale,
        seqs=2,
        entropy=3 * scale,
        pg_clipfrac=1.0,
        ppo_kl=0.2,
        logprob_diff=0.4 * scale,
        logprob_diff_tokens=4,
        padding_positions=6,
        positions=24,
        is_units=10,
        is_total=9,
        is_squares=8.5,
        is_outside=1,
        logprob_diff_max=0.3 * scale,
        is_raw_max=1.5 * scale,
    )


def test_micro_batches_add_up_by_name() -> None:
    total = StepSums()
    total.add(_rank(1.0))
    total.add(_rank(2.0))
    assert total.tokens == 30 and total.entropy == 9 and total.positions == 48
    assert total.logprob_diff_max == 0.6 and total.is_raw_max == 3.0  # maxima, not sums


def test_ranks_reduce_by_name() -> None:
    """Two ranks through a collective that combines their tensors as torch.distributed does."""
    ranks = [_rank(1.0), _rank(3.0)]
    sent: list = []  # rank 1's tensors, in the order its collectives ran
    ranks[1].reduced(lambda t, op: sent.append((t.clone(), op)), "cpu")
    assert [op for _, op in sent] == [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX]
    assert sum(len(t) for t, _ in sent) == len(dataclasses.fields(StepSums))

    def combine(tensor: torch.Tensor, op) -> None:
        other, other_op = sent.pop(0)
        assert op == other_op
        tensor.copy_(tensor + other if op == torch.distributed.ReduceOp.SUM else torch.maximum(tensor, other))

    both = ranks[0].reduced(combine, "cpu")
    expected = StepSums()
    expected.add(ranks[0])
    expected.add(ranks[1])
    assert both == expected and not sent


def test_metrics_are_token_means_and_rank_averages() -> None:
    sums = StepSums()
    sums.add(_rank(1.0))
    sums.add(_rank(1.0))
    m = sums.metrics(world_size=2, grad_norm=1.5, lr=1e-3)
    assert m["actor/pg_loss"] == pytest.approx(0.5) and m["actor/entropy"] == pytest.approx(6 / 20)
    assert m["actor/num_tokens"] == 20 and m["perf/padding_fraction"] == pytest.approx(0.25)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.8 / 8) and m["rollout/logprob_diff_max"] == 0.3
    assert m["rollout_is/units"] == 20 and m["rollout_is/max"] == 1.5
    assert "rollout/logprob_diff_mean" not in StepSums(tokens=4).metrics(1, 0.0, 0.0)  # no rollout log-probs
