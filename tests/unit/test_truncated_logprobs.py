"""Log-probs of the distribution the engines draw from under top-k / top-p: `truncate_logits`
cuts what HF's warpers cut (vLLM's algorithm), the HF engine returns the truncated log-probs,
as vLLM does (processed_logprobs), and the learner's forward computes the same numbers, so the
logprob_diff between them is ~0 at any sampling setting, and a mismatch stands out."""

from __future__ import annotations

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from pjray.config import ModelConfig, RolloutConfig
from pjray.models.loading import render_chat, truncate_logits
from pjray.models.tiny import build_tiny_judge
from pjray.rl.logprobs import collate, forward_logprobs
from pjray.rollout.hf_engine import HFEngine
from pjray.types import Experience
from tests.support.images import noisy_png
from tests.support.prompts import batch_prompt


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (20, 0.9), (1, 1.0), (0, 1.0)])
def test_the_cut_is_hfs_top_k_then_top_p(top_k: int, top_p: float):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(top_k)) * 3
    want = logits.clone()
    for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []):
        want = warper(None, want)
    got = truncate_logits(logits.clone(), top_k, top_p)
    assert torch.equal(got == torch.finfo(got.dtype).min, torch.isinf(want))
    assert torch.equal(got[~torch.isinf(want)], logits[~torch.isinf(want)])


def test_a_kept_id_outside_the_cut_stays_finite_and_nothing_else_changes():
    logits = torch.arange(10.0).repeat(2, 1)
    keep = torch.tensor([0, 9])  # row 0: the smallest, far outside the top 3
    got = truncate_logits(logits.clone(), top_k=3, keep=keep)
    low = torch.finfo(got.dtype).min
    assert got[0].tolist() == [0.0] + [low] * 6 + [7.0, 8.0, 9.0]
    assert got[1].tolist() == [low] * 7 + [7.0, 8.0, 9.0]
    assert torch.isfinite(torch.log_softmax(got, -1)[0, 0]) and torch.log_softmax(got, -1)[0, 0] > -20


def test_learner_logprobs_equal_the_engines_under_top_k_and_top_p(tmp_path):
    """Responses the HF engine sampled at T=0.8, top-k 8, top-p 0.9: the learner's log-probs
    with the same cut equal the engine's (1e-5); without the cut they are far off."""
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    rollout = RolloutConfig(max_new_tokens=8, temperature=0.8, top_k=8, top_p=0.9)
    engine = HFEngine(str(judge), ModelConfig(), rollout, device="cpu")
    prompts = [
        batch_prompt(str(i), "Judge.", user, image)
        for i, (user, image) in enumerate([("Rank the answers A, B and C.", noisy_png(84, 56, 3)), ("No image.", None)])
    ]
    completions = engine.generate(prompts, n=3, seed=0)
    exps = [
        Experience(
            prompt_text=render_chat(engine.processor, prompts[c.prompt_index]),
            image=prompts[c.prompt_index].image,
            response_ids=c.token_ids,
            advantage=1.0,
        )
        for c in completions
    ]
    batch = collate(engine.processor, exps)
    mask = batch.response_mask[:, 1:].bool()
    banned = engine.banned_ids
    with torch.no_grad():
        cut, stats = forward_logprobs(
            engine.model, engine.processor, batch, temperature=0.8, banned=banned, top_k=8, top_p=0.9
        )
        full, _ = forward_logprobs(engine.model, engine.processor, batch, temperature=0.8, banned=banned)
    served = torch.cat([torch.tensor(c.logprobs) for c in completions])
    assert float((cut[mask] - served).abs().max()) <= 1e-5
    assert float((full[mask] - served).abs().max()) > 0.5  # top-k 8 of 512 ids: far from the full softmax
    assert float(stats.entropy.max()) <= torch.log(torch.tensor(8.0)) + 1e-5  # at most 8 ids in play
