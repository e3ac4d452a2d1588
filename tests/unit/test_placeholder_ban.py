"""The placeholder ban on the learner's side: `ban_tokens` and `forward_logprobs(banned=...)`
compute the distribution every rollout engine samples from (placeholder ids out), and stay
finite; `nccl_options` refuses a torch without NCCL with a message that says what to use."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from pjray.models.loading import ban_tokens, load_judge, placeholder_ids, render_chat
from pjray.models.tiny import build_tiny_judge
from pjray.rl.grpo import entropy_from_logits, token_logprobs
from pjray.rl.logprobs import collate, forward_logprobs
from pjray.sync.collective import nccl_options
from pjray.types import Experience, JudgePrompt


def test_banned_tokens_get_no_probability_and_the_rest_renormalise():
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0))
    banned = torch.tensor([1, 7])
    out = ban_tokens(logits.clone(), banned)
    probs = torch.softmax(out, -1)
    assert torch.all(probs[..., banned] == 0)
    keep = [i for i in range(10) if i not in (1, 7)]
    torch.testing.assert_close(probs[..., keep], torch.softmax(logits[..., keep], -1))
    assert torch.isfinite(entropy_from_logits(out)).all()  # an -inf logit would make it NaN
    labels = torch.tensor([[0, 2, 3], [4, 5, 6]])
    expected = torch.log_softmax(logits[..., keep], -1).gather(-1, torch.tensor([[0, 1, 2], [3, 4, 5]])[..., None])[
        ..., 0
    ]
    torch.testing.assert_close(token_logprobs(out, labels), expected)
    assert torch.equal(ban_tokens(logits.clone(), torch.tensor([], dtype=torch.long)), logits)


def test_forward_logprobs_with_the_ban_is_the_renormalised_distribution(tmp_path):
    model, processor = load_judge(build_tiny_judge(tmp_path, arch="qwen2_vl", seed=0), trainable=False)
    banned = placeholder_ids(processor)
    assert len(banned) == 2 and processor.image_token_id in banned
    text = render_chat(processor, _prompt())
    ids = processor.tokenizer("<answer>A > B > C</answer>", add_special_tokens=False)["input_ids"]
    batch = collate(processor, [Experience(prompt_text=text, image=None, response_ids=tuple(ids), advantage=0.0)])
    mask = batch.response_mask[:, 1:].bool()
    with torch.no_grad():
        plain, _ = forward_logprobs(model, processor, batch, temperature=0.7)
        with_ban, stats = forward_logprobs(model, processor, batch, temperature=0.7, banned=banned)
    plain, with_ban = plain[mask], with_ban[mask]
    # The distributions carry the ban (no placeholder is the argmax) and finite entropies; each
    # token's log-prob rises by -log(1 - the placeholders' mass) > 0 for this random judge.
    assert not torch.isin(stats.greedy, torch.tensor(banned)).any()
    assert math.isfinite(float(stats.entropy.sum()))
    assert torch.all(with_ban > plain)


def _prompt() -> JudgePrompt:
    return JudgePrompt(
        item_id="x",
        system="You are a careful judge.",
        user="Rank A, B and C.",
        image=None,
        protocol="batch",
        style="ranking",
        num_candidates=3,
        shown=(0, 1, 2),
        target="ABC",
    )


@pytest.mark.skipif(dist.is_nccl_available(), reason="checks the message of a torch built without NCCL")
def test_nccl_options_on_a_torch_without_nccl_says_to_use_gloo():
    from datetime import timedelta

    with pytest.raises(RuntimeError, match="gloo"):
        nccl_options(timedelta(seconds=5))
