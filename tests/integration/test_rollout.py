"""HFEngine and RolloutWorker on tiny random Qwen2-VL judges (CPU, Ray local).

A freshly initialised tiny judge is nearly uniform over its 512 tokens: it hardly depends on
positions or context (so a broken padding path would go unnoticed) and it almost never emits
`<|im_end|>`. The tests therefore edit its saved weights into two variants:

* sharp: every matrix scaled by 10, so logits spread over several nats and shift strongly with
  positions and context. A left-padding / M-RoPE bug moves its logprobs by ~1 nat.
* stopping: channel 0 of every token embedding is a large constant, which survives to the
  final RMSNorm and feeds a large `<|im_end|>` logit, so responses stop at random lengths.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import time
from pathlib import Path

import PIL.Image
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from pjray.config import ModelConfig, RolloutConfig
from pjray.models.families import token_types
from pjray.models.loading import load_judge, processor_inputs, render_chat
from pjray.models.tiny import build_tiny_judge
from pjray.placement import RankGroup
from pjray.rollout import hf_engine as rollout_module
from pjray.rollout.engine import RolloutEngine
from pjray.rollout.hf_engine import HFEngine
from pjray.rollout.worker import RolloutWorker, submit_generation
from pjray.sync.buckets import Bucket, BucketEntry, pack, plan_buckets, state_checksums
from pjray.types import Completion, JudgePrompt, Timed
from tests.support.prompts import batch_prompt

MAX_NEW_TOKENS = 16
N = 4


def _png(colour: str, size: int) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def _prompt(item_id: str, user: str, image: bytes | None, system: str = "Judge the answers.") -> JudgePrompt:
    return batch_prompt(item_id, system, user, image)


# Different lengths and image sizes, and one text-only prompt: left padding, several image
# grids and a mixed batch in one generate call.
PROMPTS = [
    _prompt("a", "Which answer is right?", _png("red", 64)),
    _prompt("b", "Rank the three answers about the shapes in this image, best first.", _png("blue", 112)),
    _prompt("c", "No image here.", None, system=""),
]


def _edit_weights(path: Path, variant: str) -> None:
    """Turn the saved tiny judge at `path` into the `sharp` or `stopping` variant (see above)."""
    weights = load_file(path / "model.safetensors")
    if variant == "sharp":
        weights = {k: v * 10 if v.dim() >= 2 else v for k, v in weights.items()}
    elif variant == "stopping":
        # After the final RMSNorm channel 0 is large and positive at every position, and the
        # EOS row of lm_head reads it: P(EOS) is a few percent per step.
        embed = next(k for k in weights if k.endswith("embed_tokens.weight"))
        weights[embed][:, 0] = 50.0
        weights["lm_head.weight"][2, 0] = 0.35  # id 2 is <|im_end|> in the tiny tokenizer
    else:
        raise ValueError(variant)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    """The sharp variant: context-sensitive, so sampling and padding bugs show."""
    path = build_tiny_judge(tmp_path_factory.mktemp("judge_sharp"), seed=0)
    _edit_weights(path, "sharp")
    return str(path)


@pytest.fixture(scope="module")
def stopping_dir(tmp_path_factory) -> str:
    path = build_tiny_judge(tmp_path_factory.mktemp("judge_stopping"), seed=0)
    _edit_weights(path, "stopping")
    return str(path)


@pytest.fixture(scope="module")
def other_judge_dir(tmp_path_factory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("judge_seed1"), seed=1))


@pytest.fixture(scope="module")
def rollout_cfg() -> RolloutConfig:
    return RolloutConfig(max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(judge_dir, rollout_cfg) -> HFEngine:
    # Two prompts per chunk: the three prompts run as two generate calls.
    return HFEngine(judge_dir, ModelConfig(), rollout_cfg, max_batch_prompts=2)


@pytest.fixture(scope="module")
def stopping_engine(stopping_dir, rollout_cfg) -> HFEngine:
    return HFEngine(stopping_dir, ModelConfig(), rollout_cfg, max_batch_prompts=2)


def _bucket_refs(model: torch.nn.Module, bucket_bytes: int) -> tuple[list[Bucket], list[ray.ObjectRef]]:
    """What the learner sends: a bucket plan and one ray.put flat tensor per bucket."""
    params = dict(model.named_parameters())
    plan = plan_buckets([(name, p.shape, p.dtype) for name, p in params.items()], bucket_bytes)
    return plan, [ray.put(pack(bucket, params)) for bucket in plan]


def test_generate_shapes_order_and_finish(stopping_engine: HFEngine):
    engine = stopping_engine
    completions = engine.generate(PROMPTS, n=N, seed=0)
    assert isinstance(engine, RolloutEngine)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (p, s) for p in range(len(PROMPTS)) for s in range(N)
    ]
    eos = set(engine.eos_ids)
    for c in completions:
        assert 1 <= len(c.token_ids) <= MAX_NEW_TOKENS
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        # EOS appears only as the last token, exactly when the response stopped.
        assert not eos & set(c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in eos
        else:
            assert c.finish_reason == "length"
            assert len(c.token_ids) == MAX_NEW_TOKENS and c.token_ids[-1] not in eos
        assert c.text == engine.processor.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert not set(engine.banned_ids) & set(c.token_ids)
    # The edited judge stops often but not always: both paths are covered.
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def _assert_teacher_forced(engine: HFEngine, completions: list[Completion], temperature: float | None = None) -> None:
    """Each completion's logprobs equal one unpadded full forward pass over prompt + response,
    at the engine's sampling temperature (log softmax of logits / T, over the vocabulary
    without the banned placeholder ids: the distribution sampled from) unless another is given."""
    temperature = engine.rollout_cfg.temperature if temperature is None else temperature
    model, processor = engine.model, engine.processor
    for c in completions:
        prompt = PROMPTS[c.prompt_index]
        inputs = processor_inputs(processor, [render_chat(processor, prompt)], [prompt.image])
        prompt_len = inputs["input_ids"].shape[1]
        input_ids = torch.cat([inputs["input_ids"], torch.tensor([c.token_ids])], dim=1)
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": token_types(processor, input_ids),
        }
        if prompt.image is not None:
            kwargs["pixel_values"] = inputs["pixel_values"]
            kwargs["image_grid_thw"] = inputs["image_grid_thw"]
        with torch.no_grad():
            logits = model(**kwargs).logits[0, prompt_len - 1 : -1].float() / temperature
        logits[:, list(engine.banned_ids)] = float("-inf")
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["sharp", "stopping"])
def test_logprobs_match_teacher_forced_forward(variant: str, request):
    """Batched, left-padded sampling (M-RoPE with padding, cached decoding) against one
    unpadded full forward per sequence; the stopping variant checks the trim at EOS."""
    engine: HFEngine = request.getfixturevalue("engine" if variant == "sharp" else "stopping_engine")
    _assert_teacher_forced(engine, engine.generate(PROMPTS, n=N, seed=1))


def test_logprobs_are_of_the_sampling_temperature(judge_dir):
    """At T=0.7 the recorded logprobs are of logits / T, the distribution sampled from (what the
    learner computes), not of the raw logits."""
    engine = HFEngine(judge_dir, ModelConfig(), RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.7))
    completions = engine.generate(PROMPTS, n=2, seed=1)
    _assert_teacher_forced(engine, completions)
    with pytest.raises(AssertionError):
        _assert_teacher_forced(engine, completions, temperature=1.0)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_logprobs_match_teacher_forced_other_archs(arch: str, rollout_cfg, tmp_path):
    """The same check for the other tiny architectures, whose vision towers and M-RoPE layouts
    differ from Qwen2-VL's."""
    path = build_tiny_judge(tmp_path, arch=arch, seed=0)
    _edit_weights(path, "sharp")
    engine = HFEngine(str(path), ModelConfig(), rollout_cfg, max_batch_prompts=2)
    _assert_teacher_forced(engine, engine.generate(PROMPTS, n=2, seed=1))


def test_same_seed_same_samples(engine: HFEngine):
    first = engine.generate(PROMPTS, n=N, seed=3)
    assert engine.generate(PROMPTS, n=N, seed=3) == first
    other = engine.generate(PROMPTS, n=N, seed=4)
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    # Samples within a group differ too (num_return_sequences draws independently).
    assert len({c.token_ids for c in first[:N]}) > 1


def test_each_prompt_is_prefilled_once_for_its_samples(engine: HFEngine):
    """The n samples of a prompt share one prefill: the first forward of a chunk sees each
    distinct prompt once, every later one a single token of each of the prompts x n rows."""
    shapes: list[tuple[int, ...]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        engine.generate(PROMPTS[:2], n=N, seed=0)  # one chunk (max_batch_prompts=2)
    finally:
        hook.remove()
    assert shapes[0][0] == 2 and shapes[0][1] > 1
    assert len(shapes) > 2 and set(shapes[1:]) == {(2 * N, 1)}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 40, "top_p": 0.9}])
def test_samples_equal_hf_generate(stopping_dir: str, sampling: dict):
    """The engine draws what transformers `generate` draws from the same weights and seed (the
    prompt repeated per sample, placeholder ids suppressed, HF's temperature, top-k and top-p),
    stopping at EOS the same way: the prefill-once sampler changes the cost, not the samples."""
    cfg = RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, **sampling)
    engine = HFEngine(stopping_dir, ModelConfig(), cfg, max_batch_prompts=len(PROMPTS))
    seed = 5
    got = engine.generate(PROMPTS, n=N, seed=seed)
    processor = engine.processor
    inputs = processor_inputs(
        processor, [render_chat(processor, p) for p in PROMPTS], [p.image for p in PROMPTS], "left"
    )
    torch.manual_seed(rollout_module._chunk_seed(seed, 0))
    with torch.no_grad():
        sequences = engine.model.generate(
            **{k: v for k, v in inputs.items() if v is not None},
            do_sample=True,
            num_return_sequences=N,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            suppress_tokens=list(engine.banned_ids),
            eos_token_id=list(engine.eos_ids),
            pad_token_id=engine.pad_id,
        )
    eos = set(engine.eos_ids)
    want = []
    for row in sequences[:, inputs["input_ids"].shape[1] :].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        want.append(tuple(row[:stop]))
    assert [c.token_ids for c in got] == want
    assert "stop" in {c.finish_reason for c in got}  # rows end at different steps


def test_load_weights_syncs_and_changes_outputs(judge_dir, other_judge_dir, rollout_cfg, ray_local):
    engine = HFEngine(judge_dir, ModelConfig(), rollout_cfg)
    before = engine.generate(PROMPTS, n=2, seed=0)
    source, _ = load_judge(other_judge_dir, trainable=False)
    assert engine.checksums() != state_checksums(source.named_parameters())

    # Small buckets: many transfers, and parameters of one bucket are copied from views.
    plan, refs = _bucket_refs(source, bucket_bytes=64 * 1024)
    assert len(plan) > 1
    engine.load_weights(plan, refs)

    assert engine.checksums() == state_checksums(source.named_parameters())
    after = engine.generate(PROMPTS, n=2, seed=0)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_load_weights_rejects_bad_plans(engine: HFEngine, ray_local):
    before = engine.checksums()
    name, param = next(iter(engine.model.named_parameters()))
    flat = ray.put(param.detach().reshape(-1).clone())

    def one_entry(entry_name: str, shape: torch.Size) -> Bucket:
        entry = BucketEntry(entry_name, shape, param.dtype, 0, param.numel())
        return Bucket(param.dtype, (entry,), param.numel())

    with pytest.raises(ValueError, match="unknown parameter 'no.such.weight'"):
        engine.load_weights([one_entry("no.such.weight", param.shape)], [flat])
    with pytest.raises(ValueError, match=re.escape(f"parameter '{name}' is")):
        engine.load_weights([one_entry(name, torch.Size([param.numel()]))], [flat])
    with pytest.raises(ValueError, match="1 buckets in the plan but 0 refs"):
        engine.load_weights([one_entry(name, param.shape)], [])
    assert engine.checksums() == before  # a rejected plan changes nothing


def test_rollout_worker_through_ray(judge_dir, other_judge_dir, rollout_cfg, ray_local):
    worker_cls = ray.remote(num_cpus=0.5)(RolloutWorker)
    # The engine fixture chunks by 2; the worker uses the default chunk size, so compare
    # against a direct engine with the same (default) chunking.
    direct = HFEngine(judge_dir, ModelConfig(), rollout_cfg)
    worker = worker_cls.remote(judge_dir, ModelConfig(), rollout_cfg, 0)
    assert ray.get(worker.ready.remote())
    assert ray.get(worker.pid.remote()) != os.getpid()

    remote = ray.get(worker.generate.remote(PROMPTS, N, 11))
    local = direct.generate(PROMPTS, n=N, seed=11)
    assert [dataclasses.replace(c, logprobs=()) for c in remote] == [dataclasses.replace(c, logprobs=()) for c in local]
    # The actor runs with one intra-op thread, so float sums may round differently.
    for r, loc in zip(remote, local):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(loc.logprobs), atol=1e-5, rtol=0)
    assert all(isinstance(c, Completion) for c in remote)

    # A sync through the actor: refs travel inside a list and are fetched by the worker.
    source, _ = load_judge(other_judge_dir, trainable=False)
    plan, refs = _bucket_refs(source, bucket_bytes=64 * 1024 * 1024)
    ray.get(worker.load_weights.remote(plan, refs))
    assert ray.get(worker.checksums.remote()) == state_checksums(source.named_parameters())
    ray.kill(worker)


class _SlowGenerator:
    """A rollout worker that takes a second to generate nothing and says when it finished."""

    def __init__(self) -> None:
        self.finished: float | None = None

    def generate_timed(self, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
        time.sleep(1.0)
        self.finished = time.time()
        return Timed([], 1.0)

    def finished_at(self) -> float | None:
        return self.finished


def test_a_sync_starts_only_after_the_generations_in_flight(ray_local):
    """Async rollouts: before the trainer posts a weight sync it waits for the generations it
    started ahead (`PendingGeneration.wait_finished`), so learner rank 0's broadcast never waits
    on a generation queued before the receive (NCCL's watchdog would count that time)."""
    workers = [ray.remote(num_cpus=0.1)(_SlowGenerator).remote() for _ in range(2)]
    pending = submit_generation(RankGroup(workers), PROMPTS, n=1, seed=0)
    started = time.time()
    pending.wait_finished()
    waited_until = time.time()
    finished = ray.get([w.finished_at.remote() for w in workers])
    assert all(f is not None and f <= waited_until for f in finished) and waited_until - started >= 0.9
    assert pending.result().value == []
    for w in workers:
        ray.kill(w)


def test_the_checkpoint_is_staged_once_on_each_node(ray_local, judge_dir, tmp_path):
    """`model.stage_dir` on a (one-node) Ray cluster: a task on the node copies the judge to
    local disk, a second staging reuses the copy, and an engine loads the copy."""
    from pjray.staging import stage_on_nodes

    node = ray.get_runtime_context().get_node_id()
    staged = stage_on_nodes(judge_dir, str(tmp_path / "local"), [node, node])
    assert Path(staged).parent == tmp_path / "local" and Path(staged, "config.json").exists()
    stamp = Path(staged, "config.json").stat().st_mtime_ns
    assert stage_on_nodes(judge_dir, str(tmp_path / "local"), [node]) == staged
    assert Path(staged, "config.json").stat().st_mtime_ns == stamp
    engine = HFEngine(staged, ModelConfig(), RolloutConfig(max_new_tokens=4))
    assert engine.checksums() == HFEngine(judge_dir, ModelConfig(), RolloutConfig(max_new_tokens=4)).checksums()
