"""learner.offload_during_generation: a colocated rank moves its optimizer's states off the GPU
when it hands its memory to the engines (`release_memory`), never the weights its forwards read,
and back before the next update or checkpoint, once each way (`pjray.rl.policy.PolicyModel`).
The DeepSpeed calls themselves need CUDA (tests/integration/test_learner.py's GPU test); here a
stand-in engine records them."""

from __future__ import annotations

import deepspeed
import pytest
import torch

from pjray.config import ConfigError, LearnerConfig, load
from pjray.rl.checkpoint import RankCheckpoints
from pjray.rl.ds_setup import optimizer
from pjray.rl.policy import PolicyModel


class CountingEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.included: list[str] = []

    def offload_states(self, include=None) -> None:
        # DeepSpeed offloads every state when `include` is None, the bf16 weights too.
        assert include is not None
        self.calls.append("offload")
        self.included = sorted(state.value for state in include)

    def reload_states(self) -> None:
        self.calls.append("reload")

    def save_checkpoint(self, path, client_state=None) -> None:
        self.calls.append("save")

    def load_checkpoint(self, path, **kw):
        self.calls.append("load")
        return path, {}


def _rank(enabled: bool) -> PolicyModel:
    policy = PolicyModel.__new__(PolicyModel)  # the set-up needs a process group; only these fields matter
    policy.learner_cfg = LearnerConfig(offload_during_generation=enabled)
    policy.engine = CountingEngine()
    policy.ds = deepspeed
    policy.states_offloaded = False
    return policy


def test_states_leave_once_per_generation_and_return_before_the_update(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rank = _rank(enabled=True)
    rank.release_memory()
    rank.release_memory()  # a second release (a refresh) offloads nothing more
    assert rank.engine.included == ["contiguous_grad_buffer", "hp_params", "lp_grads", "optim_states"]
    rank.states_on_gpu()
    rank.states_on_gpu()  # already back
    assert rank.engine.calls == ["offload", "reload"]
    off = _rank(enabled=False)
    off.release_memory()
    off.states_on_gpu()
    assert off.engine.calls == []


def test_a_checkpoint_brings_the_states_back_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rank = _rank(enabled=True)
    checkpoints = RankCheckpoints.__new__(RankCheckpoints)
    checkpoints.model = rank
    rank.release_memory()
    checkpoints.save_checkpoint("ckpt")
    rank.release_memory()
    checkpoints.load_checkpoint("ckpt")
    assert rank.engine.calls == ["offload", "reload", "save", "offload", "reload", "load"]


def test_zero3_offload_during_generation_steps_with_deepspeeds_fused_adam(monkeypatch):
    """ZeRO-3 moves its optimizer's states only when that optimizer is FusedAdam (a CUDA op,
    stood in for here); every other set-up keeps torch's AdamW."""
    import deepspeed.ops.adam

    class StandIn:
        def __init__(self, groups, **kw):
            self.groups, self.kw = groups, kw

    monkeypatch.setattr(deepspeed.ops.adam, "FusedAdam", StandIn)
    model = torch.nn.Linear(4, 4)
    fused = optimizer(model, LearnerConfig(zero_stage=3, offload_during_generation=True, lr=1e-5))
    assert isinstance(fused, StandIn) and fused.kw["adam_w_mode"] and fused.kw["lr"] == 1e-5
    assert sum(len(g["params"]) for g in fused.groups) == 2
    for cfg in (LearnerConfig(zero_stage=2, offload_during_generation=True), LearnerConfig(zero_stage=3)):
        assert type(optimizer(model, cfg)) is torch.optim.AdamW


def test_on_cpu_nothing_moves(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rank = _rank(enabled=True)
    rank.release_memory()
    assert rank.engine.calls == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.offload_during_generation=true"], "only colocated GPU ranks"),
        (
            [
                "learner.offload_during_generation=true",
                "rollout.colocate=true",
                "rollout.backend=vllm",
                "rollout.device=cuda",
                "learner.num_gpus_per_rank=0.5",
                "rollout.num_gpus_per_worker=0.4",
                "learner.offload=optimizer",
            ],
            "the states live in CPU memory already",
        ),
    ],
)
def test_it_is_refused_where_it_cannot_help(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)
