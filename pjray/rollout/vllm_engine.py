"""The vLLM rollout engine: `RolloutEngine` over `vllm.LLM`, and its weight-sync worker extension.

`VllmEngine(model_path, model_cfg, rollout_cfg)` keeps every semantic `pjray.rollout.engine`
documents for engines, so the driver and the reward never see which backend ran. Log-probs are
vLLM's "processed" ones: of logits / temperature with the placeholder ids banned (a logit bias,
applied before vLLM computes them), as the learner computes them (`forward_logprobs(banned=...)`);
with top-k or top-p on they are of the truncated distribution, which `rollout/logprob_diff_*` shows.

vLLM's engine core runs in a process of its own (its default, on GPU and on CPU), where a tensor
argument of `collective_rpc` arrives as a list: plans, handles and weights cross as bytes
(`dumps`, `flat_bytes`) or as paths.

Images: vLLM gets the raw `render_chat` text (ONE un-expanded placeholder) and the decoded image
(`vllm_request`) and expands the placeholder itself. It never sees processor-expanded ids, so
image tokens cannot be expanded twice (an M-RoPE crash or a silently corrupted prompt in other
frameworks); the learner builds its own inputs from the same text and image with the HF processor.

Weights arrive in one call per sync, by transport (`VllmEngine`); each vLLM worker loads them with
the model's own `load_weights` inside vLLM's layerwise in-place reload (`WeightSyncExtension`).
The served model is what vLLM's `get_model()` returns (`served_model`): with CUDA graphs the model
runner's `model` attribute is a wrapper, and a load through it is not sure to reach the model.
vLLM's parameter names differ from the learner's (fused qkv / gate_up), so `checksums()` compares
two engines; an engine and the learner are compared through logprobs (the tests do).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import ray
import torch

from pjray.config import VLLM_LORA_RANKS, ModelConfig, RolloutConfig
from pjray.data.images import decode_image
from pjray.models.families import family_of, family_of_type
from pjray.models.loading import load_processor, placeholder_ids, render_chat
from pjray.rollout.engine import checkpoint_eos_ids, stop_token_ids
from pjray.sync.adapter import AdapterUpdate
from pjray.sync.buckets import Bucket, flat_bytes, from_bytes, state_checksums, unpack
from pjray.sync.collective import GroupAddress, dumps, loads, receive_buckets
from pjray.sync.ipc import open_ipc_handle, slot_view
from pjray.sync.shared import SharedBucketReader
from pjray.types import Completion, JudgePrompt

__all__ = ["VllmEngine", "WeightSyncExtension", "served_model", "vllm_request"]

# vLLM caps a logit bias at +-100: exp(-100) is 0 in every float format, an exact ban.
_BAN_BIAS = -100.0
# How long an engine call's error may precede vLLM's mark that the engine died (a fraction of a
# second on CPU: benchmarks/results/design_notes.md), with a wide margin.
ENGINE_DEATH_GRACE_S = 3.0


def vllm_request(processor: Any, prompt: JudgePrompt, think_prefix: bool = True) -> dict[str, Any]:
    """What vLLM receives for one judge prompt: raw chat text, and the image beside it.

    Returns {"prompt": render_chat text} plus, when the prompt has an image,
    {"multi_modal_data": {"image": PIL image}}. The text holds exactly one un-expanded
    placeholder per image; vLLM's own processor expands it, once.
    """
    request: dict[str, Any] = {"prompt": render_chat(processor, prompt, think_prefix=think_prefix)}
    if prompt.image is not None:
        request["multi_modal_data"] = {"image": decode_image(prompt.image)}
    return request


def _prompt_seed(seed: int, prompt_index: int) -> int:
    """A per-request sampling seed: vLLM seeds each request on its own, so the samples of a
    prompt do not depend on which other prompts share the batch."""
    return int(np.random.SeedSequence([seed, prompt_index]).generate_state(1, dtype=np.uint32)[0] >> 1)


# The HF name suffix of the input embedding a tied head shares (every Qwen LM and VLM).
TIED_EMBEDDING = "embed_tokens.weight"


def tied_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The output heads (`ParallelLMHead`) of a vLLM model that share their weight tensor with an
    input embedding (tie_word_embeddings)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = [m.weight for m in model.modules() if type(m) is VocabParallelEmbedding]
    return [m for m in model.modules() if isinstance(m, ParallelLMHead) and any(m.weight is e for e in embeddings)]


def served_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker serves, through vLLM's unwrapping accessor.

    `Worker.get_model()` (what `LLM.apply_model` hands its function) asks the model runner's
    `get_model()`: the V1 GPU runner unwraps its CUDA-graph and micro-batch wrappers there (its
    `model` attribute IS the wrapper when graphs are on); the V2 GPU runner and the CPU runner
    keep the model unwrapped and return it. Loads, reloads and checksums all go through here.
    """
    return worker.get_model()


def release_cached_memory(device: torch.device) -> None:
    """Return the CUDA caching allocator's free blocks on `device` to the driver (nothing off
    CUDA). A load's temporary tensors (each bucket's copy) leave cached blocks that the
    allocator keeps reserved; a colocated engine's KV cache, which wakes after the sync, and
    the learner need that memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class WeightSyncExtension:
    """Methods added to every vLLM worker (`worker_extension_cls`), called by `collective_rpc`.

    A worker loads buckets with the model's own `load_weights` (HF names in, vLLM's fused layout
    out) inside vLLM's layerwise in-place reload (`pjray_begin_update` / `pjray_finish_update`),
    which re-runs each layer's post-load processing (e.g. repacked CPU linear weights); a head
    tied to the input embedding (Qwen3-VL-4B) is fed the embedding too, or its processed copy
    would keep the old weights. After every load the worker returns its CUDA caching allocator's
    free blocks (the buckets' copies) to the driver, so the KV cache that wakes next finds the
    memory it had. `self` is the vLLM worker: `served_model(self)` is the served model, `self.rank` the
    worker's rank inside its engine, `self.device` its device. Arguments are plain types: plans
    and handles pickled (`pjray.sync.collective.dumps`), weights as raw bytes or shared-memory paths (an
    engine core in its own process decodes a tensor argument as a list).
    """

    def pjray_init_sync_group(self, address: bytes, rank_offset: int) -> int:
        """Join the broadcast group at `address` (a pickled `GroupAddress`) as rank
        `rank_offset + self.rank`; returns that rank."""
        old = getattr(self, "_pjray_group", None)
        if old is not None:
            old.close()
        rank = rank_offset + int(self.rank)
        self._pjray_group = loads(address).join(rank)
        return rank

    def pjray_receive_broadcast(self, plan: bytes) -> None:
        """Receive every bucket of `plan` from learner rank 0 and load it (one update). If the
        collective fails (a member died), this rank leaves the group, as the learner's does."""
        self.pjray_begin_update()
        try:
            receive_buckets(self._pjray_group, loads(plan), self._pjray_load)
        except Exception:
            self._pjray_group.close()
            raise
        self.pjray_finish_update()

    def pjray_begin_ipc(self, handles: bytes) -> None:
        """Map the colocated learner rank's slots (`pjray.sync.ipc`) and start an update."""
        device_index = torch.cuda.current_device()
        self._pjray_slots = [open_ipc_handle(handle, device_index) for handle in loads(handles)]
        self.pjray_begin_update()

    def pjray_load_ipc_bucket(self, bucket: bytes, slot: int) -> None:
        """Load one bucket from slot `slot`. From a copy: vLLM's layerwise reload keeps the tensors
        it is given until their layer is complete, possibly a later bucket, and the learner packs
        another bucket into this slot as soon as this returns."""
        plan_entry = loads(bucket)
        self._pjray_load(plan_entry, slot_view(self._pjray_slots[slot], plan_entry).clone())
        torch.cuda.synchronize()  # read before the learner writes the slot again

    def pjray_finish_ipc(self) -> None:
        # Every bucket was copied out of the slots (`pjray_load_ipc_bucket`): unmap them (the
        # learner frees them), then finish, which empties the allocator's cached blocks.
        self._pjray_slots = []
        self.pjray_finish_update()

    def pjray_begin_update(self) -> None:
        """Start an in-place reload of the checkpoint-format weights.

        After loading, vLLM post-processes some layers into a kernel layout (e.g. repacked
        linear weights on CPU) and drops their loaders, so `load_weights` cannot simply run
        again. vLLM's layerwise reload restores each layer's checkpoint-format parameters,
        takes the new weights (in any number of `load_weights` calls) and re-runs the
        processing once a layer is complete; every parameter must arrive before
        `pjray_finish_update` (the learner always sends all of them).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if not hasattr(self, "_pjray_tied_heads"):
            self._pjray_tied_heads = tied_heads(served_model(self))  # before params go to meta
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(served_model(self))

    def pjray_load_bucket(self, bucket: bytes, data: bytes) -> None:
        """Load one bucket sent through the RPC itself as raw bytes (the object-store path),
        between `pjray_begin_update` and `pjray_finish_update`. Bytes, not a tensor: an engine
        core in a process of its own decodes an RPC's tensor arguments as lists."""
        plan_entry = loads(bucket)
        self._pjray_load(plan_entry, from_bytes(plan_entry, data).to(self.device))

    def pjray_load_shared(self, plan: bytes, paths: list[str]) -> None:
        """Same-node sync: map learner rank 0's shared-memory buffers (once per path) and load
        them (one update). Only the paths cross the RPC."""
        if not hasattr(self, "_pjray_shared"):
            self._pjray_shared = SharedBucketReader()
        buckets = loads(plan)
        self.pjray_begin_update()
        for bucket, view in zip(buckets, self._pjray_shared.views(buckets, paths)):
            self._pjray_load(bucket, view.to(self.device))
        self.pjray_finish_update()

    def pjray_finish_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(served_model(self), self.vllm_config.model_config)
        release_cached_memory(torch.device(self.device))

    def pjray_checksums(self) -> dict[str, str]:
        return state_checksums(served_model(self).named_parameters())

    def _pjray_load(self, bucket: Bucket, flat: torch.Tensor) -> None:
        from vllm.config import set_current_vllm_config

        # The model's own loader maps HF names (in the layout of the family's released
        # checkpoints) onto vLLM's fused, tensor-parallel layout.
        family = family_of_type(self.vllm_config.model_config.hf_config.model_type)
        weights = {family.released_name(n) if family else n: t for n, t in unpack(bucket, flat).items()}
        with set_current_vllm_config(self.vllm_config):
            served_model(self).load_weights(weights=list(weights.items()))
            # A tied head (tie_word_embeddings) shares the embedding's tensor, and the model's
            # loader skips lm_head.*; but the reload processes each layer apart, and a head that
            # received nothing keeps its post-processed copy (e.g. the CPU GEMM's packed weight)
            # of the old weights. So the embedding is fed to the head's own loader too.
            for name, tensor in weights.items():
                if name.endswith(TIED_EMBEDDING):
                    for head in self._pjray_tied_heads:
                        head.weight.weight_loader(head.weight, tensor)


# Tokens one engine step may prefill on CPU (whole prompts only, `llm_kwargs`).
CPU_BATCHED_TOKENS = 8192


def cpu_engine_env() -> None:
    """Settings for vLLM's CPU build, made before `vllm` is imported: a 1 GiB KV cache (a user's
    setting wins). The engine core runs in a process of its own, as vLLM runs it on GPUs, so
    the CPU tests take the path GPU runs take (every RPC argument crosses a process boundary)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def llm_kwargs(model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, processor: Any) -> dict[str, Any]:
    """The arguments of `vllm.LLM` for this engine (pure: no vLLM import)."""
    sleep = rollout_cfg.colocate
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": model_cfg.dtype,
        "tensor_parallel_size": rollout_cfg.tensor_parallel_size,
        "max_model_len": rollout_cfg.max_model_len,
        "enable_prefix_caching": True,
        "enable_sleep_mode": sleep,
        # Sampling comes from RolloutConfig only, never from the checkpoint's defaults.
        "generation_config": "vllm",
        "worker_extension_cls": f"{__name__}.WeightSyncExtension",
        # Sampled tokens' logprobs after temperature (the learner's quantity), not the raw ones.
        "logprobs_mode": "processed_logprobs",
        "seed": 0,
    }
    # Compiled (torch.compile; CUDA graphs on GPU) unless asked otherwise; on CPU eager by
    # default, since compiling a test-sized model costs more than it saves.
    eager = rollout_cfg.enforce_eager
    kwargs["enforce_eager"] = rollout_cfg.device == "cpu" if eager is None else eager
    if rollout_cfg.device == "cpu":
        # No chunked prefill on CPU: a prompt whose prefill is split over steps samples a token
        # that is thrown away, and vLLM then rewinds the request's seeded generator, which a CPU
        # generator cannot do ("CPU Generator does not use offset": the engine core dies). A
        # step's budget of max_model_len tokens holds any whole prompt.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(rollout_cfg.max_model_len, CPU_BATCHED_TOKENS)
    else:
        kwargs["gpu_memory_utilization"] = rollout_cfg.gpu_memory_utilization
        # TP ranks as processes of this actor, on the GPUs Ray gave it (one node).
        if rollout_cfg.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
    family = family_of(processor)
    if model_cfg.lora.sync == "adapter" and family is not None and not family.vllm_lora:
        raise ValueError(
            f"model.lora.sync=adapter: vLLM serves no LoRA adapter on a {family.name} judge; "
            "set model.lora.sync=merged (the engines get merged weights)"
        )
    if model_cfg.lora.sync == "adapter":
        # Adapter sync: vLLM applies the learner's adapter; one at a time (each sync replaces it).
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = 1
        kwargs["max_lora_rank"] = min(r for r in VLLM_LORA_RANKS if r >= model_cfg.lora.rank)
    if family is not None:
        kwargs["limit_mm_per_prompt"] = {"image": 1, "video": 0}
        if family.pixel_budget:
            # The learner's image budget (`ModelConfig.image_budget`, `load_processor`), so
            # both sides resize an image to the same grid.
            size = processor.image_processor.size
            kwargs["mm_processor_kwargs"] = {
                "size": {"shortest_edge": size.shortest_edge, "longest_edge": size.longest_edge}
            }
        if sleep:
            # Every sleep clears the processor cache (its front-end half, and with it what the
            # engine core mirrors), so a sleeping engine gains nothing from it but its host
            # memory (4 GiB by default) and the risk of the two halves disagreeing: off.
            kwargs["mm_processor_cache_gb"] = 0
    return kwargs


class VllmEngine:
    """Rollouts with `vllm.LLM` (GPU, or vLLM's CPU build).

    The engine lives inside a `RolloutWorker` actor, which holds rollout.tensor_parallel_size
    GPUs (split mode) or a share of one learner GPU (colocated, with sleep mode). Compiled by
    default on GPU (torch.compile, CUDA graphs), eager on CPU (`rollout.enforce_eager`); a load
    copies into the tensors the graphs captured, so they serve the new weights.

    Weights, one call per sync from the driver (trainer.sync_backend):
    - object_store: `load_weights(plan, refs)`, one bucket at a time from the object store to
      every vLLM worker; works for any layout (also brings one rebuilt worker up to date);
    - shm: `load_shared(plan, paths)`: the workers map learner rank 0's shared-memory buffers;
    - gloo / nccl: `init_weight_sync(...)` once, then `receive_weights(plan)`: every vLLM rank
      receives all buckets by broadcast from learner rank 0 in one RPC (`pjray.sync`);
    - ipc: `begin_ipc`, `load_ipc_bucket` per bucket, `finish_ipc`, called by the colocated
      learner rank itself through two CUDA buffers every worker maps (`pjray.sync.ipc`);
    - adapter (model.lora.sync=adapter, LoRA on with one slot): `load_adapter(update)`.
    After every sync the encoder cache and the prefix cache (both of the old weights) are reset;
    vLLM's multimodal processor cache (pixel values, grid sizes) is kept, except on colocated
    engines, which run without it since every sleep clears it. Colocated engines sleep while the
    learner trains (`sleep`): a sync wakes the weights alone and loads them, and the KV cache
    wakes only at `wake_up`, after the learner has released its buffers and cached blocks.
    """

    def __init__(self, model_path: str, model_cfg: ModelConfig, rollout_cfg: RolloutConfig) -> None:
        self.model_cfg, self.rollout_cfg = model_cfg, rollout_cfg
        if rollout_cfg.device == "cpu":
            cpu_engine_env()
        from vllm import LLM  # noqa: PLC0415  (imported only when this backend is chosen)

        self.processor = load_processor(model_path, model_cfg.image_budget)
        # The engine runs with generation_config="vllm" (sampling from RolloutConfig only), so the
        # checkpoint's EOS ids are read here and passed as stop tokens.
        self.eos_ids: tuple[int, ...] = stop_token_ids(
            self.processor.tokenizer, checkpoint_eos_ids(model_path), model_path
        )
        self.banned_ids: tuple[int, ...] = placeholder_ids(self.processor)
        self.sleep_enabled = rollout_cfg.colocate
        self.sleep_level = rollout_cfg.sleep_level
        self.sleeping: set[str] = set()  # what sleep() released and no wake-up brought back yet

        kwargs = llm_kwargs(model_path, model_cfg, rollout_cfg, self.processor)
        self.llm = LLM(**kwargs)
        self.lora_enabled = bool(kwargs.get("enable_lora"))
        self.lora: Any = None  # the LoRARequest every request carries, after an adapter sync
        self._adapters = 0  # adapter syncs so far: the next adapter's id

    # -- generation -----------------------------------------------------------------------

    def sampling_params(self, n: int, seed: int) -> Any:
        from vllm import SamplingParams

        cfg = self.rollout_cfg
        return SamplingParams(
            n=n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,  # 0 = off, as in RolloutConfig
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # the sampled token's logprob (processed: after temperature)
            logit_bias={i: _BAN_BIAS for i in self.banned_ids} or None,
            seed=seed,
            skip_special_tokens=True,
        )

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        """n samples per prompt, ordered by (prompt_index, sample_index)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.sleeping:
            self.wake_up()
        requests = [vllm_request(self.processor, p, self.model_cfg.think_prefix) for p in prompts]
        params = [self.sampling_params(n, _prompt_seed(seed, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora)
        decode = self.processor.tokenizer.decode
        completions: list[Completion] = []
        for prompt_index, request_output in enumerate(outputs):
            for sample_index, out in enumerate(request_output.outputs):
                token_ids = tuple(out.token_ids)
                logprobs = tuple(float(step[tok].logprob) for step, tok in zip(out.logprobs, token_ids))
                completions.append(
                    Completion(
                        prompt_index=prompt_index,
                        sample_index=sample_index,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        text=decode(token_ids, skip_special_tokens=True),
                        finish_reason="length" if out.finish_reason == "length" else "stop",
                    )
                )
        return completions

    def continuation_logprobs(self, prompt: JudgePrompt, continuation: tuple[int, ...]) -> list[float]:
        """Logprob of each token of `continuation` after `prompt` under the served weights.

        One prefill with prompt logprobs (no sampling): how tests compare the engine with the
        learner after a sync. They are vLLM's prompt logprobs: of the raw logits (temperature
        1, no placeholder ban), the learner's `forward_logprobs` with no `banned` ids. An image
        prompt goes in as token ids with ONE un-expanded placeholder beside its image, which
        vLLM expands as it does the text; the continuation is the prompt's last tokens, so
        expansion does not move it.
        """
        from vllm import SamplingParams

        if not continuation:
            return []
        if self.sleeping:
            self.wake_up()
        request = vllm_request(self.processor, prompt, self.model_cfg.think_prefix)
        prompt_ids = self.processor.tokenizer(request.pop("prompt"), add_special_tokens=False)["input_ids"]
        request["prompt_token_ids"] = list(prompt_ids) + list(continuation)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        out = self.llm.generate([request], params, use_tqdm=False, lora_request=self.lora)[0]
        steps = out.prompt_logprobs[-len(continuation) :]
        return [float(step[tok].logprob) for step, tok in zip(steps, continuation)]

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, plan: list[Bucket], refs: list[Any]) -> None:
        """Object-store sync: fetch one bucket at a time and load it on every vLLM worker."""
        if len(plan) != len(refs):
            raise ValueError(f"load_weights: {len(plan)} buckets in the plan but {len(refs)} refs")
        self._before_load()
        self.llm.collective_rpc("pjray_begin_update")
        for bucket, ref in zip(plan, refs):
            flat = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
            self.llm.collective_rpc("pjray_load_bucket", args=(dumps(bucket), flat_bytes(flat)))
            del flat
        self.llm.collective_rpc("pjray_finish_update")
        self._after_load()

    def load_shared(self, plan: list[Bucket], paths: list[str]) -> None:
        """Same-node sync: every vLLM worker maps learner rank 0's shared-memory buffers."""
        if len(plan) != len(paths):
            raise ValueError(f"load_shared: {len(plan)} buckets in the plan but {len(paths)} buffers")
        self._before_load()
        self.llm.collective_rpc("pjray_load_shared", args=(dumps(plan), list(paths)))
        self._after_load()

    def load_adapter(self, update: AdapterUpdate) -> None:
        """Adapter sync: serve the base weights with the learner's LoRA adapter `update`, under a
        new adapter id, from now on. The previous adapter leaves the engine (and its directory
        the disk) first: the engine holds one adapter slot.

        The adapter is written in PEFT's format to a fresh directory and served as a new
        `LoRARequest`: a new id per sync, so vLLM never serves a cached older adapter under the
        same id. The engine starts with LoRA on (`enable_lora`, one slot, `max_lora_rank` the
        smallest vLLM offers at least model.lora.rank); the base weights stay those loaded at
        start-up (with LoRA they never train)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise RuntimeError("load_adapter: this engine was started without LoRA (model.lora.sync is not adapter)")
        self._adapters += 1
        directory = update.write(tempfile.mkdtemp(prefix=f"pjray-adapter-{self._adapters}-"))
        request = LoRARequest(f"policy-{self._adapters}", self._adapters, str(directory))
        old, self.lora = self.lora, None
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"load_adapter: vLLM did not load the adapter written to {directory}")
        self.lora = request
        self._after_load()

    def init_weight_sync(self, address: GroupAddress, rank_offset: int) -> list[int]:
        """Join the learner's broadcast group, this engine's workers from rank `rank_offset` on;
        returns their ranks."""
        return self.llm.collective_rpc("pjray_init_sync_group", args=(dumps(address), rank_offset))

    def receive_weights(self, plan: list[Bucket]) -> None:
        """Broadcast sync: every vLLM rank receives all buckets of `plan` in one RPC."""
        self._before_load()
        self.llm.collective_rpc("pjray_receive_broadcast", args=(dumps(plan),))
        self._after_load()

    def begin_ipc(self, handles: list[Any]) -> None:
        """Colocated sync, streamed (`pjray.sync.ipc.stream_buckets`): map the learner rank's
        slots on every vLLM worker and start an update; `load_ipc_bucket` per bucket, then
        `finish_ipc`."""
        self._before_load()
        self.llm.collective_rpc("pjray_begin_ipc", args=(dumps(handles),))

    def load_ipc_bucket(self, bucket: Bucket, slot: int) -> None:
        self.llm.collective_rpc("pjray_load_ipc_bucket", args=(dumps(bucket), slot))

    def finish_ipc(self) -> None:
        self.llm.collective_rpc("pjray_finish_ipc")
        self._after_load()

    def _before_load(self) -> None:
        if "weights" in self.sleeping:
            # Weights only: the KV cache stays released until `wake_up`, so the learner's
            # buffers and the engine's weights are all that share the GPU during the sync.
            self.llm.wake_up(tags=["weights"])
            self.sleeping.discard("weights")

    def _after_load(self) -> None:
        # Encoder outputs (the vision tower's embeddings of images already seen) are cached per
        # image: they were computed with the old weights.
        self.llm.llm_engine.reset_encoder_cache()
        if "kv_cache" not in self.sleeping:
            # Cached KV blocks were computed with the old weights (a sleeping cache is reset
            # when it wakes).
            self.llm.reset_prefix_cache()

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of vLLM's own parameters on its rank 0 (vLLM's names)."""
        return self.llm.collective_rpc("pjray_checksums")[0]

    def compilation(self) -> dict[str, str]:
        """How the engine runs its model, as vLLM resolved it: eager or not, the compilation
        mode (NONE: eager; the CPU build compiles with DYNAMO_TRACE_ONCE) and the CUDA-graph
        mode (NONE on CPU)."""
        vllm_config = self.llm.llm_engine.vllm_config
        compilation = vllm_config.compilation_config
        return {
            "enforce_eager": str(vllm_config.model_config.enforce_eager),
            "mode": compilation.mode.name,
            "cudagraph_mode": compilation.cudagraph_mode.name,
        }

    def alive(self) -> bool:
        """False once vLLM's client has marked its engine core dead (the core, or one of its
        workers, exited: a CUDA error, an out-of-memory kill, a lost collective peer). Read from
        the engine-core client's resources: `vllm.LLM` has no public health call."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)  # a core in its own process
        return resources is None or not resources.engine_dead

    def is_dead(self, err: BaseException) -> bool:
        """Whether `err` comes from an engine that died. A call in flight when a worker died
        fails first with the core's own message ("Call to collective_rpc method failed:
        cancelled"), a moment before the client marks the engine dead, so an error other than
        `EngineDeadError` waits up to `ENGINE_DEATH_GRACE_S` for that mark."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(err, EngineDeadError):
            return True
        deadline = time.monotonic() + ENGINE_DEATH_GRACE_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.alive()

    def close(self) -> None:
        """Stop vLLM's engine core (its process, when it runs in one) now, not at garbage
        collection (through the engine-core client: `vllm.LLM` has no public shutdown)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora is not None:
            shutil.rmtree(self.lora.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Release weights and KV cache (colocated engines, while the learner trains); a no-op
        without sleep mode. At rollout.sleep_level=2 (the default) the weights are discarded, at 1
        kept in pinned host memory: at 2 the sync that follows every sleep loads all of them."""
        if self.sleep_enabled and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Take back what `sleep` released and a sync has not (after a sync: the KV cache).

        At sleep level 2 the weights come back only through a sync (`_before_load`, then a load
        of every weight): woken here they would be memory that nothing wrote, and the engine
        would serve it without an error. The colocated layout syncs after every sleep, so
        this is refused rather than done.
        """
        if "weights" in self.sleeping and self.sleep_level == 2:
            raise RuntimeError(
                "VllmEngine.wake_up: the weights were discarded at rollout.sleep_level=2 and no sync "
                "has loaded them since; sync the learner's weights first (or use rollout.sleep_level=1)"
            )
        if self.sleeping:
            self.llm.wake_up(tags=sorted(self.sleeping))
            if "kv_cache" in self.sleeping:
                self.llm.reset_prefix_cache()  # its blocks hold nothing valid after sleep
            self.sleeping = set()
