"""Every judge family (`pjray.models.families`) through the learner and the HF engine, on tiny
random judges: the checkpoint and processor round trip, the learner's log-probs against a plain
per-row forward (unshared, shared-prefix and packed), the gradients of one step however it is cut
or packed, the vision part frozen and left out of LoRA, and the HF engine's sampled log-probs
against the learner's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from pjray.config import LoraConfig, ModelConfig, RolloutConfig
from pjray.models.families import FAMILIES, family_of, token_types
from pjray.models.loading import load_judge, load_processor, placeholder_ids, processor_inputs, render_chat
from pjray.models.lora import apply_lora
from pjray.models.tiny import build_tiny_judge
from pjray.models.tiny_families import FAMILY_ARCHS, build_tiny_family_judge
from pjray.rl.grpo import LossSettings, grpo_loss
from pjray.rl.logprobs import collate, forward_logprobs, take_rows
from pjray.rl.microbatch import token_budget_batches
from pjray.rollout.hf_engine import HFEngine
from pjray.types import Experience, JudgePrompt
from tests.support.images import noisy_png
from tests.support.prompts import batch_prompt

ARCHS = ("qwen2_vl", *FAMILY_ARCHS)  # a Qwen-VL judge beside the others: the same checks hold


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch in ARCHS:
        build = build_tiny_judge if arch == "qwen2_vl" else build_tiny_family_judge
        out[arch] = str(build(root / arch, arch=arch, seed=0))
    return out


def _prompt(i: int, image: bytes | None) -> JudgePrompt:
    return batch_prompt(str(i), "You are a careful judge.", "Rank the answers A, B and C. " * (1 + i % 2), image)


def _experiences(processor, seed: int = 1) -> list[Experience]:
    """Seven rows: images of several sizes and aspect ratios, a row without one, two rows that
    share a prompt, responses from short to long (one with a placeholder id, one with an
    untrained span)."""
    rng = random.Random(seed)
    out = []
    for i in range(6):
        image = None if i == 2 else noisy_png(40 + 30 * i, 56 + 12 * (i % 3), seed * 10 + i)
        text = render_chat(processor, _prompt(i, image))
        ids = tuple(rng.randrange(0, 400) for _ in range(rng.choice([2, 7, 19])))
        out.append(Experience(prompt_text=text, image=image, response_ids=ids, advantage=rng.uniform(-1.5, 1.5)))
    out[4] = Experience(out[3].prompt_text, out[3].image, out[4].response_ids, out[4].advantage)
    out[1] = Experience(out[1].prompt_text, out[1].image, (5, placeholder_ids(processor)[0], 7, 9), out[1].advantage)
    n = len(out[5].response_ids)
    out[5] = Experience(
        out[5].prompt_text, out[5].image, out[5].response_ids, 1.0, loss_mask=(False,) * 2 + (True,) * (n - 2)
    )
    return [*out, Experience(prompt_text=out[0].prompt_text, image=out[0].image, response_ids=(11, 12), advantage=0.5)]


def _plain_logprobs(model, processor, e: Experience) -> torch.Tensor:
    """The reference: one row through the processor and the model as transformers documents it."""
    enc = processor_inputs(processor, [e.prompt_text], [e.image])
    ids = torch.cat([enc["input_ids"], torch.tensor([e.response_ids])], 1)
    start = enc["input_ids"].shape[1]
    # A placeholder id in a response is fed as the pad (the learner's rule), read as itself.
    fed = ids.clone()
    fed[0, start:][torch.isin(fed[0, start:], torch.tensor(placeholder_ids(processor)))] = (
        processor.tokenizer.pad_token_id
    )
    kwargs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    family = family_of(processor)
    if family.token_types:
        kwargs[family.token_types] = token_types(processor, fed)
    with torch.no_grad():
        logits = model(input_ids=fed, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float()
    return torch.log_softmax(logits[start - 1 : -1], -1).gather(-1, torch.tensor(e.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_family_checkpoint_reloads_as_built_in_the_released_layout(judges: dict[str, str], arch: str) -> None:
    path = judges[arch]
    processor = load_processor(path)
    family = family_of(processor)
    assert family is not None and arch in family.model_types
    saved = json.loads(open(f"{path}/processor_config.json").read())
    assert saved["processor_class"] == type(processor).stock_class_name()
    # The stock processor's own settings survive the round trip (they size the image tokens).
    settings = [k for k in type(processor)._settings() if k in saved]
    assert settings and all(saved[k] == getattr(processor, k) for k in settings)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys == [family.released_name(k) for k in keys]  # written as released checkpoints are
    _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # and transformers reads it back
    # Each image expands to its slots, and only the judge's placeholder ids are banned.
    text = render_chat(processor, _prompt(0, noisy_png(64, 48, 0)))
    assert text.count(processor.image_token) == 1
    ids = processor_inputs(processor, [text], [noisy_png(64, 48, 0)])["input_ids"]
    assert int((ids == family.slot_id(processor)).sum()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_learner_logprobs_equal_a_plain_forward_however_laid_out(judges: dict[str, str], arch: str) -> None:
    """fp32: unshared, shared-prefix and packed forwards give each row's plain forward (1e-5)."""
    model, processor = load_judge(judges[arch], trainable=False)
    exps = _experiences(processor)
    want = [_plain_logprobs(model, processor, e) for e in exps]
    batch = collate(processor, exps)
    for shared, packed in [(False, False), (True, False), (False, True)]:
        with torch.no_grad():
            logp, _ = forward_logprobs(model, processor, batch, shared_prefix=shared, packed=packed)
        for i, e in enumerate(exps):
            start, n = int(batch.prompt_lens[i]), len(e.response_ids)
            got = logp[i, start - 1 : start - 1 + n]
            mask = batch.response_mask[i, start : start + n].bool()
            gap = float((got[mask] - want[i][mask]).abs().max())
            assert gap <= 1e-5, (arch, shared, packed, i, gap)


def _step_grads(model, processor, exps, cuts, packed: bool) -> dict[str, torch.Tensor]:
    whole = collate(processor, exps)
    tokens, seqs = float(whole.response_mask.sum()), float((whole.response_mask.sum(-1) > 0).sum())
    for rows in cuts:
        batch = take_rows(whole, rows)
        logp, _ = forward_logprobs(model, processor, batch, temperature=0.7, shared_prefix=False, packed=packed)
        mask = batch.response_mask[:, 1:]
        loss, _ = grpo_loss(
            logp, logp.detach() - 0.05 * mask, None, batch.advantages, mask, LossSettings(), tokens, seqs, 1
        )
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_steps_gradient_does_not_depend_on_how_it_is_cut_or_packed(judges: dict[str, str], arch: str) -> None:
    """fp32: one micro-batch, budgeted padded and budgeted packed micro-batches give the same
    gradient of every parameter (1e-5 relative), the vision part's included. A gradient that is
    0 in exact arithmetic (an attention key's bias) is float noise: it is measured against 1e-4
    of the largest gradient."""
    model, processor = load_judge(judges[arch], trainable=True)
    exps = _experiences(processor, seed=2)
    lengths = [int(n) for n in collate(processor, exps).attention_mask.sum(-1)]
    want = _step_grads(model, processor, exps, [list(range(len(exps)))], False)
    vision = family_of(processor).vision_parts
    assert any(f".{part}." in name for name in want for part in vision)
    for packed in (False, True):
        cuts = token_budget_batches(lengths, max(lengths) * 2, packed=packed)
        assert len(cuts) > 1
        got = _step_grads(model, processor, exps, cuts, packed)
        assert got.keys() == want.keys()
        floor = 1e-4 * max(float(g.norm()) for g in want.values())
        for name, g in want.items():
            rel = float((got[name] - g).norm() / g.norm().clamp_min(floor))
            assert rel <= 1e-5, (packed, name, rel)


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_the_vision_part_is_frozen_and_left_out_of_lora(judges: dict[str, str], arch: str) -> None:
    model, processor = load_judge(judges[arch], trainable=True)
    family = family_of(processor)
    parts = family.vision_modules(model)
    assert parts and all(sum(p.numel() for p in m.parameters()) > 0 for m in parts)
    adapted = apply_lora(model, LoraConfig(rank=4))
    lora_names = [n for n, _ in adapted.named_parameters() if ".lora_" in n]
    assert lora_names
    assert not [n for n in lora_names if any(f".{part}." in n for part in family.vision_parts)]
    assert [n for n in lora_names if "language_model" in n or "text_model" in n]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_hf_engine_samples_with_the_learners_logprobs(judges: dict[str, str], arch: str) -> None:
    """Sampled at T=0.9 on images of several sizes (and a prompt without one): the engine's
    log-probs are the learner's teacher-forced ones (1e-5), placeholders never sampled."""
    path = judges[arch]
    model_cfg, rollout_cfg = ModelConfig(path=path), RolloutConfig(max_new_tokens=10, temperature=0.9)
    engine = HFEngine(path, model_cfg, rollout_cfg)
    prompts = [_prompt(i, None if i == 1 else noisy_png(48 + 24 * i, 56, i)) for i in range(3)]
    out = engine.generate(prompts, n=2, seed=0)
    assert len({c.token_ids for c in out}) > 1
    assert not {t for c in out for t in c.token_ids} & set(placeholder_ids(engine.processor))
    exps = [
        Experience(
            render_chat(engine.processor, prompts[c.prompt_index]), prompts[c.prompt_index].image, c.token_ids, 0.0
        )
        for c in out
    ]
    batch = collate(engine.processor, exps)
    with torch.no_grad():
        logp, _ = forward_logprobs(
            engine.model, engine.processor, batch, temperature=0.9, banned=placeholder_ids(engine.processor)
        )
    mask = batch.response_mask[:, 1:].bool()
    gap = max(float((torch.tensor(c.logprobs) - logp[i][mask[i]]).abs().max()) for i, c in enumerate(out))
    assert gap <= 1e-5, gap


def test_every_family_has_a_tiny_judge_and_one_processor_class() -> None:
    covered = {t for f in FAMILIES for t in f.model_types}
    assert set(FAMILY_ARCHS) <= covered and "qwen2_vl" in covered
    assert len({f.processor for f in FAMILIES}) == len(FAMILIES)  # a processor names its family
