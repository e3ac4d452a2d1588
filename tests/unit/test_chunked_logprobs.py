"""`forward_logprobs` projects the response positions through the output embedding a chunk at a
time: the same log-probs, gradients, entropies and argmaxes as projecting every position at once,
with and without a shared prompt, through a PEFT wrapper, and no [tokens, V] logits kept for
backward."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pjray.config import LoraConfig
from pjray.models.loading import ban_tokens, load_judge, placeholder_ids
from pjray.models.lora import apply_lora
from pjray.models.tiny import build_tiny_judge
from pjray.rl.grpo import entropy_from_logits, token_logprobs
from pjray.rl.logprobs import can_share_prefix, collate, forward_logprobs, model_inputs
from pjray.types import Experience
from tests.support.images import noisy_png


def _groups(image_token_id: int | None, seed: int = 1) -> list[Experience]:
    """Three prompts (two with images where the judge has a vision tower) of three responses of
    varied length each (one with an image-pad id, one with an untrained span), and a padding row."""
    rng = random.Random(seed)
    out = []
    for g in range(3):
        image = noisy_png(56 + 28 * g, 56, seed * 100 + g) if g < 2 and image_token_id is not None else None
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>" if image else ""
        user = "Rank the answers A, B and C. " * (1 + g)
        prompt = f"<|im_start|>user\n{placeholder}{user}<|im_end|>\n<|im_start|>assistant\n"
        for _ in range(3):
            ids = tuple(rng.randrange(0, 400) for _ in range(rng.randrange(2, 12)))
            out.append(Experience(prompt_text=prompt, image=image, response_ids=ids, advantage=rng.uniform(-1.5, 1.5)))
    if image_token_id is not None:
        out[1] = dataclasses.replace(out[1], response_ids=(5, image_token_id, 7, 9))
    out[4] = dataclasses.replace(out[4], loss_mask=(True, False) + (True,) * (len(out[4].response_ids) - 2))
    return [*out, Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)]


def _one_pass(model, processor, batch, temperature: float, banned) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every position's logits at once, (log-probs [B, T-1], logits [B, T-1, V])."""
    logits = model(**model_inputs(processor, batch, torch.device("cpu")), use_cache=False).logits[:, :-1] / temperature
    ban_tokens(logits, torch.tensor(list(banned), dtype=torch.long))
    return token_logprobs(logits, batch.input_ids[:, 1:]), logits


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, g in want.items():
        rel = float((got[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= 1e-5, (name, rel)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "qwen2"])
def test_chunks_give_the_one_pass_numbers_and_gradients(tmp_path, arch: str) -> None:
    """fp32: log-probs within 1e-5 of the one-pass projection, parameter gradients within 1e-5
    relative, entropies and argmaxes of the same distributions, for chunks of 1, 3 and more than
    all positions, each prompt forwarded once or per row; 0 off the trained positions."""
    model, processor = load_judge(str(build_tiny_judge(tmp_path, arch=arch, seed=0)), trainable=True)
    banned = placeholder_ids(processor)
    batch = collate(processor, _groups(processor.image_token_id))
    assert can_share_prefix(model, batch)
    mask = batch.response_mask[:, 1:].bool()
    weights = mask * batch.advantages[:, None]
    ref, logits = _one_pass(model, processor, batch, 0.7, banned)
    (ref * weights).sum().backward()
    ref_grads = _grads(model)
    for shared in (False, True):
        for chunk in (1, 3, 4096):
            logp, stats = forward_logprobs(
                model, processor, batch, temperature=0.7, shared_prefix=shared, banned=banned, chunk_tokens=chunk
            )
            (logp * weights).sum().backward()
            assert logp.dtype == torch.float32 and logp.shape == mask.shape
            assert float((logp[mask] - ref[mask]).abs().max().detach()) <= 1e-5
            assert torch.all(logp.detach()[~mask] == 0)
            _assert_same_grads(_grads(model), ref_grads)
            torch.testing.assert_close(stats.entropy, entropy_from_logits(logits.detach()[mask]), atol=1e-5, rtol=0)
            assert torch.equal(stats.greedy, logits.detach()[mask].argmax(-1))
            assert not stats.entropy.requires_grad


def test_no_logits_of_all_positions_are_kept_for_backward(tmp_path) -> None:
    """The model's own projection runs on no position; every other call projects at most one
    chunk, in the forward and again in the backward's recomputation; no activation saved for
    backward has the vocabulary as its last dimension."""
    model, processor = load_judge(str(build_tiny_judge(tmp_path, arch="qwen2_vl", seed=0)), trainable=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = collate(processor, _groups(processor.image_token_id))
    n = int(batch.response_mask[:, 1:].sum())
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(out.numel() // vocab))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[tuple[int, ...]] = []  # shapes of the activations saved for backward (not weights)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(tuple(t.shape))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = forward_logprobs(model, processor, batch, shared_prefix=False, chunk_tokens=4)
        forward_rows = list(rows)
        logp.sum().backward()
    finally:
        hook.remove()
    chunks = [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert forward_rows == [0, *chunks]
    assert sorted(rows[len(forward_rows) :]) == sorted(chunks)  # each chunk recomputed once
    assert saved and not [s for s in saved if s[-1] == vocab]


def test_a_peft_model_and_a_batch_without_responses(tmp_path) -> None:
    """Through a PEFT wrapper the adapters get the one-pass gradients; a batch of padding rows
    gives zeros and empty stats and still backpropagates."""
    model, processor = load_judge(str(build_tiny_judge(tmp_path, arch="qwen2", seed=0)), trainable=True)
    peft = apply_lora(model, LoraConfig(rank=4))
    torch.manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # PEFT starts B at 0; give the adapters a gradient path both ways
    batch = collate(processor, _groups(None))
    mask = batch.response_mask[:, 1:].bool()
    ref, _ = _one_pass(peft, processor, batch, 1.0, ())
    (ref * mask).sum().backward()
    ref_grads = _grads(peft)
    assert ref_grads and all("lora_" in name for name in ref_grads)
    logp, _ = forward_logprobs(peft, processor, batch, chunk_tokens=5)
    (logp * mask).sum().backward()
    assert float((logp[mask] - ref[mask]).abs().max().detach()) <= 1e-5
    _assert_same_grads(_grads(peft), ref_grads)

    empty = collate(processor, [Experience(prompt_text="pad", image=None, response_ids=(), advantage=0.0)] * 2)
    logp, stats = forward_logprobs(peft, processor, empty)
    assert torch.all(logp == 0) and stats.entropy.shape == (0,) and stats.greedy.shape == (0,)
    logp.sum().backward()
    with pytest.raises(ValueError, match="chunk_tokens"):
        forward_logprobs(peft, processor, batch, chunk_tokens=0)
