"""learner.offload_during_generation: a colocated rank moves its optimizer's states off the GPU
when it hands its memory to the engines (`release_memory`) and back before the next update,
once each way (`pjray.rl.policy.PolicyModel`). The DeepSpeed calls themselves need CUDA (tests/integration/test_learner.py's
GPU test); here a stand-in engine counts them."""

from __future__ import annotations

import pytest
import torch

from pjray.config import ConfigError, LearnerConfig, load
from pjray.rl.policy import PolicyModel


class CountingEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def offload_states(self) -> None:
        self.calls.append("offload")

    def reload_states(self) -> None:
        self.calls.append("reload")


def _rank(enabled: bool) -> PolicyModel:
    policy = PolicyModel.__new__(PolicyModel)  # the set-up needs a process group; only these fields matter
    policy.learner_cfg = LearnerConfig(offload_during_generation=enabled)
    policy.engine = CountingEngine()
    policy.states_offloaded = False
    return policy


def test_states_leave_once_per_generation_and_return_before_the_update(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rank = _rank(enabled=True)
    rank.release_memory()
    rank.release_memory()  # a second release (a refresh) offloads nothing more
    rank.states_on_gpu()
    rank.states_on_gpu()  # already back
    assert rank.engine.calls == ["offload", "reload"]
    off = _rank(enabled=False)
    off.release_memory()
    off.states_on_gpu()
    assert off.engine.calls == []


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
