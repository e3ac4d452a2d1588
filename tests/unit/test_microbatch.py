"""Token-budget micro-batches: the partitioning (`pjray.rl.microbatch`), rows cut out of a
collated shard (`take_rows`), and the packed forward: one step's gradient is the same however
its sequences are cut and laid out (fixed, budgeted padded, budgeted packed)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pjray.models.loading import load_judge, placeholder_ids
from pjray.models.tiny import build_tiny_judge
from pjray.rl.grpo import LossSettings, grpo_loss
from pjray.rl.logprobs import collate, forward_logprobs, forwarded_positions, take_rows
from pjray.rl.microbatch import batch_cost, karmarkar_karp, token_budget_batches
from pjray.types import Experience
from tests.support.images import noisy_png


def _covers(parts: list[list[int]], n: int) -> bool:
    return sorted(i for p in parts for i in p) == list(range(n)) and all(p == sorted(p) for p in parts)


def test_karmarkar_karp_balances_where_greedy_cutting_does_not():
    # The textbook case: 8 7 6 5 4 into 2 parts; LDM gives sums 16 and 14.
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert _covers(parts, 5)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.randrange(1, 100) for _ in range(rng.randrange(1, 12))]
        k = rng.randrange(1, 5)
        parts = karmarkar_karp(costs, k)
        assert len(parts) == k and _covers([p for p in parts if p], len(costs))
        sums = [sum(costs[i] for i in p) for p in parts]
        # Never worse than the largest item or the average plus it (a greedy bound).
        assert max(sums) <= sum(costs) / k + max(costs)
    assert karmarkar_karp([], 3) == [[], [], []]
    with pytest.raises(ValueError):
        karmarkar_karp([1], 0)


def test_budget_batches_fit_cover_and_isolate_the_overlong():
    rng = random.Random(1)
    for packed, _ in itertools.product((True, False), range(60)):
        lengths = [rng.choice([rng.randrange(10, 60), rng.randrange(200, 900)]) for _ in range(rng.randrange(1, 20))]
        budget = rng.randrange(300, 2000)
        parts = token_budget_batches(lengths, budget, packed)
        assert parts and all(parts) and _covers(parts, len(lengths))
        for p in parts:
            assert batch_cost([lengths[i] for i in p], packed) <= budget or len(p) == 1
        if packed:  # no fewer micro-batches can hold the tokens
            fitting = [n for n in lengths if n <= budget]
            assert len(parts) >= len(lengths) - len(fitting) + -(-sum(fitting) // budget)
    assert token_budget_batches([5000, 10, 10], 100, packed=True) == [[0], [1, 2]]
    assert token_budget_batches([5000, 10, 10], 100, packed=False) == [[0], [1, 2]]
    assert token_budget_batches([], 100, packed=True) == []
    # Padded runs are neighbours in length: the short rows are not padded to the long ones.
    assert token_budget_batches([100, 10, 100, 10], 200, packed=False) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        token_budget_batches([1], 0, packed=True)


def _skewed(image_token_id: int | None, seed: int = 3) -> list[Experience]:
    """Ten sequences: images of two sizes (and none), prompts and responses from short to long,
    a shared prompt, an untrained span and a padding row."""
    rng = random.Random(seed)
    out = []
    for i in range(9):
        image = None
        if image_token_id is not None and i % 3:
            image = noisy_png(56, 56, i) if i % 3 == 1 else noisy_png(112, 84, i)
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>" if image else ""
        user = "Rank the answers. " * (1 + 3 * (i % 2))
        prompt = f"<|im_start|>user\n{placeholder}{user}<|im_end|>\n<|im_start|>assistant\n"
        length = rng.choice([2, 3, 40, 60])
        out.append(
            Experience(
                prompt_text=prompt,
                image=image,
                response_ids=tuple(rng.randrange(0, 400) for _ in range(length)),
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    out[4] = Experience(out[3].prompt_text, out[3].image, out[4].response_ids, out[4].advantage)  # a shared prompt
    out[5] = Experience(
        out[5].prompt_text,
        out[5].image,
        out[5].response_ids,
        out[5].advantage,
        loss_mask=(False,) * 2 + (True,) * (len(out[5].response_ids) - 2),
    )
    return [*out, Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)]


def test_rows_taken_from_a_shard_are_the_rows_collated_alone(tmp_path):
    _, processor = load_judge(str(build_tiny_judge(tmp_path, arch="qwen2_vl", seed=0)), trainable=False)
    exps = _skewed(processor.image_token_id)
    whole = collate(processor, exps)
    for rows in ([0], [3, 4, 9], [8, 1, 5]):
        got, want = take_rows(whole, rows), collate(processor, [exps[r] for r in rows])
        for name in ("input_ids", "attention_mask", "response_mask", "advantages", "prompt_lens", "prompt_group"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(torch.nan_to_num(got.old_logprobs), torch.nan_to_num(want.old_logprobs))
        for a, b in zip(got.vision, want.vision):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # no image: {}
    idle = take_rows(whole, [2], trained=False)
    assert idle.response_mask.sum() == 0 and idle.attention_mask.sum() == whole.attention_mask[2].sum()


def _step_grads(model, processor, exps, cuts, packed: bool, banned) -> dict[str, torch.Tensor]:
    """The gradient of one GRPO step's loss, its micro-batches cut as `cuts` says."""
    whole = collate(processor, exps)
    tokens = float(whole.response_mask.sum())
    seqs = float((whole.response_mask.sum(-1) > 0).sum())
    settings = LossSettings(clip_low=0.2, clip_high=0.28)
    for rows in cuts:
        batch = take_rows(whole, rows)
        logp, _ = forward_logprobs(
            model, processor, batch, temperature=0.7, shared_prefix=False, banned=banned, packed=packed
        )
        mask = batch.response_mask[:, 1:]
        old = logp.detach() - 0.05 * mask  # off-policy enough that ratios are not all 1
        loss, _ = grpo_loss(logp, old, None, batch.advantages, mask, settings, tokens, seqs, 1)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "qwen2"])
def test_a_steps_gradient_does_not_depend_on_how_it_is_cut_or_packed(tmp_path, arch: str):
    """fp32: one micro-batch of all rows, fixed runs of 4, budgeted padded and budgeted packed
    micro-batches give the same parameter gradients (<= 1e-5 relative, every parameter)."""
    model, processor = load_judge(str(build_tiny_judge(tmp_path, arch=arch, seed=0)), trainable=True)
    banned = placeholder_ids(processor)
    exps = _skewed(processor.image_token_id)
    lengths = [int(n) for n in collate(processor, exps).attention_mask.sum(-1)]
    assert max(lengths) > 3 * min(lengths)  # skewed: padding is most of a fixed micro-batch
    want = _step_grads(model, processor, exps, [list(range(len(exps)))], False, banned)
    assert want
    for cuts, packed in [
        ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], False),
        (token_budget_batches(lengths, max(lengths) * 2, packed=False), False),
        (token_budget_batches(lengths, max(lengths) * 2, packed=True), True),
    ]:
        assert len(cuts) > 1
        got = _step_grads(model, processor, exps, cuts, packed, banned)
        assert got.keys() == want.keys()
        for name, g in want.items():
            rel = float((got[name] - g).norm() / g.norm().clamp_min(1e-30))
            assert rel <= 1e-5, (cuts, packed, name, rel)


def test_a_packed_forward_counts_no_padding(tmp_path):
    _, processor = load_judge(str(build_tiny_judge(tmp_path, arch="qwen2_vl", seed=0)), trainable=False)
    batch = collate(processor, _skewed(processor.image_token_id))
    padding, total = forwarded_positions(batch, shared=False)
    assert padding > 0 and total == batch.attention_mask.numel()
    assert forwarded_positions(batch, shared=False, packed=True) == (0, int(batch.attention_mask.sum()))
