"""Adapter-only weight sync (model.lora.sync=adapter, `pjray.sync.adapter`): the message a LoRA
learner sends, the HF engine that applies it through PEFT, and the config rules around it.

After an adapter sync the HF engine serves the learner's policy: its sampled tokens' log-probs and
the teacher-forced log-probs of the learner (`forward_logprobs` on the PEFT model) agree, its
merged checksums equal the learner's, and the message is the adapter's bytes, a small fraction of
the merged weights'. A second sync moves the engine to the new adapter.
"""

from __future__ import annotations

import pytest
import torch

from pjray.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig, load
from pjray.models.loading import load_judge, render_chat
from pjray.models.lora import apply_lora, export_view
from pjray.models.tiny import build_tiny_judge
from pjray.rl.logprobs import collate, forward_logprobs
from pjray.rollout.hf_engine import HFEngine
from pjray.sync.adapter import AdapterUpdate, adapter_update
from pjray.sync.buckets import state_checksums
from pjray.types import Experience, JudgePrompt


def _prompt(user: str) -> JudgePrompt:
    return JudgePrompt(
        item_id=user[:8],
        system="You are a careful judge.",
        user=user,
        image=None,
        protocol="batch",
        style="ranking",
        num_candidates=3,
        shown=(0, 1, 2),
        target="ABC",
    )


PROMPTS = [_prompt("Which answer is right? A: red B: blue C: green"), _prompt("Rank the three answers.")]
ROLLOUT = RolloutConfig(backend="hf", max_new_tokens=8, temperature=0.8)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=0))


def _learner(judge_dir: str, rank: int = 8, targets: tuple[str, ...] = ("all-linear",)) -> torch.nn.Module:
    """The learner's PEFT judge with adapters moved off their initial B = 0 (as training does)."""
    model, _ = load_judge(judge_dir, trainable=True)
    peft = apply_lora(model, LoraConfig(rank=rank, alpha=16.0, target_modules=list(targets)))
    _step_adapters(peft, seed=0)
    return peft


def test_a_text_only_judge_takes_adapters_without_a_vision_exclusion(judge_dir: str) -> None:
    """A text-only judge has no vision tower to leave out: its LoRA config excludes nothing (PEFT
    warns about an exclusion that matches no module), and every linear layer is adapted."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft = _learner(judge_dir)
    assert not [w for w in caught if "exclude_modules" in str(w.message)]
    assert peft.peft_config["default"].exclude_modules is None
    assert any(".lora_A." in n for n, _ in peft.named_parameters())


def _step_adapters(peft: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)


def _teacher_forced(peft: torch.nn.Module, processor, completions, temperature: float) -> list[torch.Tensor]:
    """The learner's log-probs of each completion's tokens (the rollout's temperature)."""
    experiences = [
        Experience(
            prompt_text=render_chat(processor, PROMPTS[c.prompt_index]),
            image=None,
            response_ids=c.token_ids,
            advantage=0.0,
        )
        for c in completions
    ]
    batch = collate(processor, experiences)
    mask = batch.response_mask[:, 1:].bool()
    with torch.no_grad():
        logp, _ = forward_logprobs(peft, processor, batch, temperature=temperature)
    return [logp[i][mask[i]] for i in range(len(completions))]


def _max_diff(completions, learner: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(c.logprobs) - want).abs().max()) for c, want in zip(completions, learner))


def test_hf_engine_serves_the_learners_policy_after_an_adapter_sync(judge_dir: str) -> None:
    peft = _learner(judge_dir)
    _, processor = load_judge(judge_dir, trainable=False)
    engine = HFEngine(judge_dir, ModelConfig(), ROLLOUT)
    base_sums = engine.checksums()

    update = adapter_update(peft)
    adapters = {n: p for n, p in peft.named_parameters() if ".lora_" in n}
    # The message is the adapter: every LoRA tensor, its bytes, a small fraction of the weights'.
    assert len(update.tensors) == len(adapters) and update.rank == 8
    assert update.nbytes == sum(p.numel() * p.element_size() for p in adapters.values())
    merged_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert update.nbytes < 0.5 * merged_bytes  # a ~0.2M-parameter judge is mostly embeddings

    before = engine.generate(PROMPTS, n=2, seed=1)
    engine.load_adapter(update)
    # The engine's merged weights are the learner's, bit for bit, by the HF model's names.
    learner_sums = state_checksums((p.name, p.value()) for p in export_view(peft))
    assert engine.checksums() == learner_sums != base_sums

    out = engine.generate(PROMPTS, n=2, seed=1)
    assert out != before
    learner = _teacher_forced(peft, processor, out, ROLLOUT.temperature)
    assert _max_diff(out, learner) < 1e-4
    # The base model (adapter off) is another distribution: the check can fail.
    with peft.disable_adapter():
        base = _teacher_forced(peft, processor, out, ROLLOUT.temperature)
    assert _max_diff(out, base) > 1e-2

    # A second sync: the engine follows the new adapter (and no longer serves the first).
    first_sums = engine.checksums()
    _step_adapters(peft, seed=1)
    engine.load_adapter(adapter_update(peft))
    assert engine.checksums() == state_checksums((p.name, p.value()) for p in export_view(peft)) != first_sums
    again = engine.generate(PROMPTS, n=2, seed=1)
    assert _max_diff(again, _teacher_forced(peft, processor, again, ROLLOUT.temperature)) < 1e-4

    # Full weights cannot be loaded on top of a served adapter.
    with pytest.raises(RuntimeError, match="adapter"):
        engine.load_weights([], [])


def test_the_adapter_round_trips_through_peft_files(judge_dir: str, tmp_path) -> None:
    """`write` produces what PEFT (and vLLM's LoRA loader) reads: the same adapter back."""
    from peft import PeftModel

    peft = _learner(judge_dir, rank=4, targets=("q_proj", "v_proj"))
    update = adapter_update(peft)
    assert update.config["r"] == 4 and sorted(update.config["target_modules"]) == ["q_proj", "v_proj"]
    directory = update.write(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_judge(judge_dir, trainable=False)[0], str(directory))
    want = state_checksums((p.name, p.value()) for p in export_view(peft))
    assert state_checksums((p.name, p.value()) for p in export_view(loaded)) == want


def test_an_engine_refuses_an_adapter_of_another_shape(judge_dir: str) -> None:
    engine = HFEngine(judge_dir, ModelConfig(), ROLLOUT)
    engine.load_adapter(adapter_update(_learner(judge_dir, rank=4)))
    with pytest.raises(ValueError, match="differs"):
        engine.load_adapter(adapter_update(_learner(judge_dir, rank=8)))
    with pytest.raises(ValueError, match="no LoRA adapter"):
        adapter_update(load_judge(judge_dir, trainable=False)[0])
    stray = AdapterUpdate(
        adapter_update(_learner(judge_dir, rank=4)).config,
        {"base_model.model.nowhere.lora_A.weight": torch.zeros(4, 4)},
    )
    with pytest.raises(ValueError, match="match no LoRA layer"):
        engine.load_adapter(stray)


BASE = ["model.init=tiny", "model.tiny_arch=qwen2", "data.images=false"]


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ([], ""),  # no LoRA
        (["model.lora.rank=8"], ""),  # hybrid: no sync
        (["model.lora.rank=8", "rollout.backend=hf"], "adapter"),
        (["model.lora.rank=8", "rollout.backend=hf", "trainer.sync_backend=object_store"], "adapter"),
        (["model.lora.rank=8", "rollout.backend=hf", "trainer.sync_backend=shm"], "merged"),
        (["model.lora.rank=8", "rollout.backend=hf", "model.lora.sync=merged"], "merged"),
        (
            [
                "model.lora.rank=8",
                "rollout.backend=vllm",
                "rollout.device=cpu",
                "model.lora.target_modules=[q_proj,v_proj]",
            ],
            "adapter",
        ),
        (
            [
                "model.lora.rank=8",
                "rollout.backend=vllm",
                "rollout.device=cpu",
                "model.lora.target_modules=[lm_head]",
                "model.lora.sync=merged",
            ],
            "merged",
        ),
    ],
)
def test_lora_sync_resolves(overrides: list[str], mode: str) -> None:
    cfg = load(overrides=BASE + overrides)
    assert cfg.model.lora.sync_mode(cfg.rollout, cfg.trainer.sync_backend) == mode


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.lora.sync=adapter", "rollout.backend=hf"],
            "model.lora.sync=adapter: there is no adapter without LoRA",
        ),
        (
            ["model.lora.rank=8", "model.lora.sync=adapter"],
            "rollout.backend=hybrid generates with the module it trains",
        ),
        (
            ["model.lora.rank=8", "rollout.backend=hf", "model.lora.sync=adapter", "trainer.sync_backend=shm"],
            "not trainer.sync_backend=shm",
        ),
        (
            [
                "model.lora.rank=8",
                "rollout.backend=vllm",
                "rollout.num_gpus_per_worker=0.5",
                "learner.num_gpus_per_rank=0.5",
                "rollout.colocate=true",
                "model.lora.sync=adapter",
            ],
            "colocated engines discard their weights",
        ),
        (
            [
                "model.lora.rank=8",
                "rollout.backend=vllm",
                "rollout.device=cpu",
                "model.lora.target_modules=[q_proj,lm_head]",
            ],
            r"vLLM serves no LoRA adapter on \['lm_head'\]",
        ),
        (
            ["model.lora.rank=8", "rollout.backend=vllm", "rollout.device=cpu", "model.lora.vision=true"],
            "model.lora.vision: vLLM serves LoRA adapters on the language model only",
        ),
        (["model.lora.rank=1024", "rollout.backend=vllm", "rollout.device=cpu"], "up to rank 512"),
        (
            ["model.lora.rank=8", "model.lora.sync=full"],
            "model.lora.sync='full': expected one of auto, adapter, merged",
        ),
    ],
)
def test_impossible_lora_syncs_fail_with_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(overrides=BASE + overrides)
