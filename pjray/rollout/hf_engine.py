"""`HFEngine`: rollouts from a transformers model, keeping the semantics every engine keeps
(`pjray.rollout.engine`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch

from pjray.config import ModelConfig, RolloutConfig
from pjray.models.loading import (
    ban_tokens,
    continued_positions,
    load_judge,
    placeholder_ids,
    processor_inputs,
    prompt_positions,
    render_chat,
    truncate_logits,
)
from pjray.models.lora import export_view
from pjray.rollout.engine import stop_token_ids
from pjray.sync.adapter import AdapterUpdate
from pjray.sync.buckets import Bucket, state_checksums, unpack
from pjray.sync.shared import SharedBucketReader
from pjray.types import Completion, JudgePrompt

__all__ = ["HFEngine"]


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

    An adapter sync (`load_adapter`, model.lora.sync=adapter) wraps the model in PEFT once, with
    the learner's adapter config, and copies each later adapter into it: the engine then samples
    from the base weights it loaded plus the learner's adapter, as the learner's policy is.

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
        model, processor = load_judge(
            model_path,
            dtype=model_cfg.dtype,
            device=torch.device(device),
            trainable=False,
            budget=model_cfg.image_budget,
        )
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
        engine._attach(
            model, processor, model_cfg, rollout_cfg, device, max_batch_prompts, type(model).__name__, synced
        )
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
        self.eos_ids: tuple[int, ...] = stop_token_ids(tokenizer, self.model.generation_config.eos_token_id, name)
        self.pad_id: int = tokenizer.pad_token_id
        self.banned_ids: tuple[int, ...] = placeholder_ids(self.processor)
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        self._banned = torch.tensor(self.banned_ids, dtype=torch.long, device=self.device)
        # Only RolloutConfig decides how we sample: of the checkpoint's generation_config only
        # the EOS ids are read, never its sampling defaults (e.g. Qwen's top_k=20).
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self._shared = SharedBucketReader()
        self._peft: torch.nn.Module | None = None  # the PEFT wrapper of `model`, after an adapter sync

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

    def _generate_chunk(self, prompts: Sequence[JudgePrompt], first_index: int, n: int, seed: int) -> list[Completion]:
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
        [U*n, G] (the pad id after a row's EOS) and their log-probs under the distribution drawn
        from (logits / temperature, placeholders banned, top-k and top-p).

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
            # The distribution sampled from: temperature, the ban, top-k and top-p. Its log-probs
            # are what vLLM returns (processed_logprobs) and what the learner computes.
            scaled = truncate_logits(ban_tokens(logits.float() / cfg.temperature, self._banned), cfg.top_k, cfg.top_p)
            token = torch.where(alive, torch.multinomial(torch.softmax(scaled, dim=-1), 1)[:, 0], self.pad_id)
            # log softmax at the drawn token only: no [rows, V] log-prob copy a step
            logprobs.append(scaled.gather(-1, token[:, None])[:, 0] - torch.logsumexp(scaled, -1))
            tokens.append(token)
            alive &= ~torch.isin(token, self._eos)
            if step + 1 == cfg.max_new_tokens or not self._any_alive(alive):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=continued_positions(positions, position, 1),
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits, position = out.past_key_values, out.logits[:, -1], position + 1
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)

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
        if self._peft is not None:
            raise RuntimeError(
                "load_weights: this engine serves a LoRA adapter (adapter sync); merged weights "
                "loaded into its base layers would carry the adapter twice"
            )
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

    def load_adapter(self, update: AdapterUpdate) -> None:
        """Adapter sync: serve the base weights with `update`'s LoRA adapter.

        The first update wraps the model in PEFT with the adapter's config (in place: the model's
        linear layers become LoRA layers, under the same module); every update then copies its
        tensors into the adapter. An update whose config differs from the first is refused.
        """
        from peft import get_peft_model, set_peft_model_state_dict

        if self._peft is None:
            with torch.random.fork_rng(devices=[]):  # PEFT's initial values are overwritten below
                self._peft = get_peft_model(self.model, update.peft_config())
            self._peft.eval()
            self._adapter_config = update.config
        elif update.config != self._adapter_config:
            raise ValueError(
                "load_adapter: the adapter's config (rank, alpha, target modules) differs from the "
                "one this engine was wrapped with"
            )
        loaded = set_peft_model_state_dict(self._peft, update.tensors)
        if loaded.unexpected_keys:
            raise ValueError(
                f"load_adapter: {len(loaded.unexpected_keys)} adapter tensors match no LoRA layer of "
                f"the rollout model, e.g. {loaded.unexpected_keys[0]!r}"
            )

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of the served parameters by the HF model's names; with an adapter,
        of the merged weights (`pjray.models.lora.export_view`), as the learner reports them."""
        if self._peft is None:
            return state_checksums(self.model.named_parameters())
        with torch.no_grad():
            return state_checksums((p.name, p.value()) for p in export_view(self._peft))

    def sleep(self) -> None:
        """No-op: nothing outlives a generate call (see the class docstring)."""

    def wake_up(self) -> None:
        """No-op, the counterpart of `sleep`."""

    def alive(self) -> bool:
        """Always: the model runs in the actor's own process, which dies with it."""
        return True

    def is_dead(self, err: BaseException) -> bool:
        return False
