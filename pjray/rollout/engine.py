"""Rollout: sample n judge responses per prompt, and take weight updates from the learner.

`RolloutEngine` is the interface the driver talks to (through `RolloutWorker`); each backend
implements it once and keeps the semantics listed there (sampling exactly as configured, stop
only at EOS, placeholders never sampled, the learner's log-probs, deterministic in the seed), so
the driver and the reward never need to know which backend ran:

* `pjray.rollout.hf_engine.HFEngine`: a transformers model sampled with a KV cache, each prompt
  prefilled once for its n samples; the CPU default and the tested path.
  `HFEngine.around` runs it over a model already in memory: the hybrid engine
  (`rollout.backend=hybrid`), where each learner rank generates with the module it trains.
* `pjray.rollout.vllm_engine.VllmEngine` (GPU, or vLLM's CPU build): loaded lazily
  by `RolloutWorker` when `rollout.backend=vllm`, as `VllmEngine(model_path, model_cfg,
  rollout_cfg)`; it also takes broadcast (gloo / NCCL) and CUDA-IPC weight updates.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pjray.data.prompts import EOS_TOKEN
from pjray.sync.adapter import AdapterUpdate
from pjray.sync.buckets import Bucket
from pjray.types import Completion, JudgePrompt

__all__ = ["RolloutEngine", "checkpoint_eos_ids", "stop_token_ids"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the driver needs from a rollout backend (HF, vLLM). Every engine keeps these:

    * Sampling is exactly `RolloutConfig` (temperature, top_p, top_k, max_new_tokens). Sampling
      defaults shipped in a checkpoint's `generation_config.json` are ignored on purpose: a run's
      samples must not depend on which checkpoint directory they came from.
    * Generation stops only at EOS (`stop_token_ids`) or at `max_new_tokens`, never at
      `</answer>`: the `scores` style writes K answer blocks, so the first `</answer>` is not the
      end of a response. The EOS token is part of `token_ids` (with its logprob), so the learner
      trains the decision to stop; `text` skips special tokens.
    * The image / video placeholder tokens (`<|image_pad|>`, `<|video_pad|>`) are never sampled:
      in a response they would make the learner's forward pass look for image features that do
      not exist ("image features and image tokens do not match"). Random tiny judges sample them
      often; real checkpoints almost never do.
    * `logprobs[t]` is log softmax(logits / temperature) at the sampled token, over the vocabulary
      without the banned placeholders (before top-k / top-p): what the learner computes for the
      same weights (it bans them too, `pjray.models.loading.ban_tokens`), so the driver can
      measure how far the two differ (`rollout/logprob_diff_*`). With top-k and top-p off it is
      the sampler's own logprob.
    """

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """n samples per prompt, ordered by (prompt_index, sample_index). The same prompts, n and
        seed give the same completions (on the same hardware and chunking)."""
        ...

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """Copy the learner's parameters in place: `refs[i]` is one Ray ObjectRef to the flat
        tensor of `plan[i]` (`pjray.sync.buckets.pack`, put once by the learner), fetched one at a
        time so that only one bucket is in flight."""
        ...

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: copy from learner rank 0's shared-memory buffers (`pjray.sync.shared`)."""
        ...

    def load_adapter(self, update: AdapterUpdate) -> None:
        """Adapter sync (model.lora.sync=adapter): serve the base weights loaded at start-up with
        the learner's LoRA adapter `update` from then on (vLLM: a new LoRA adapter id per sync;
        HF: through PEFT)."""
        ...

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of the served parameters (to verify a sync)."""
        ...

    def sleep(self) -> None:
        """Free generation memory (KV cache, weights) while the learner trains."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep` before the next generation. An engine whose sleep discarded its weights
        (vLLM at sleep level 2) takes them back only through a sync, and refuses a wake-up
        before one."""
        ...

    def alive(self) -> bool:
        """False once the engine's own processes are gone (it will fail, or hang, every call)."""
        ...

    def is_dead(self, err: BaseException) -> bool:
        """Whether `err`, raised by a call to the engine, comes from an engine that died."""
        ...


def stop_token_ids(tokenizer: Any, checkpoint_eos: int | list[int] | None, name: str = "") -> tuple[int, ...]:
    """Where every engine stops a response: `EOS_TOKEN`, the tokenizer's EOS and every
    `eos_token_id` of the checkpoint's generation config (a Thinking or Instruct checkpoint may
    list several), without None and the unknown token (an unknown EOS_TOKEN maps to it)."""
    ids = {tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.eos_token_id}
    ids |= set(checkpoint_eos if isinstance(checkpoint_eos, list) else [checkpoint_eos])
    ids.discard(None)
    ids.discard(tokenizer.unk_token_id)
    if not ids:
        raise ValueError(f"{name}: no EOS token ({EOS_TOKEN} unknown, no eos_token, none in generation_config)")
    return tuple(sorted(ids))


def checkpoint_eos_ids(model_path: str) -> int | list[int] | None:
    """The `eos_token_id` of the checkpoint's generation_config.json (None without one)."""
    from transformers import GenerationConfig  # noqa: PLC0415

    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        return None
