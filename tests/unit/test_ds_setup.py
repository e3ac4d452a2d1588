"""The DeepSpeed config a learner rank hands DeepSpeed, and learner.offload's place in it."""

from __future__ import annotations

import dataclasses

import pytest

from pjray.config import ConfigError, LearnerConfig, load
from pjray.rl.ds_setup import ds_config, ref_ds_config

GPU = ["learner.num_gpus_per_rank=1", "rollout.backend=hf", "rollout.device=cpu"]


def test_offload_moves_optimizer_states_then_parameters_to_cpu():
    base = LearnerConfig(micro_batch_size=4, zero_stage=3)
    plain = ds_config(base, grad_accum_steps=2, world_size=2, overrides={})
    assert plain["zero_optimization"] == {"stage": 3} and plain["train_batch_size"] == 16
    states = ds_config(dataclasses.replace(base, offload="optimizer"), 2, 2, {})["zero_optimization"]
    assert states == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    everything = ds_config(dataclasses.replace(base, offload="all"), 2, 2, {})
    assert everything["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    # The reference has no optimizer: it keeps the parameter offload, not the optimizer's.
    ref = ref_ds_config(everything, base, world_size=2)["zero_optimization"]
    assert ref == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    # learner.ds_config-style overrides still win.
    tuned = ds_config(dataclasses.replace(base, offload="all"), 2, 2, {"zero_optimization": {"offload_param": {"pin_memory": False}}})
    assert tuned["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.offload=optimizer"], r"learner.offload=optimizer: the ranks run on CPU"),
        ([*GPU, "learner.offload=optimizer", "learner.zero_stage=0"], r"learner.offload=optimizer: ZeRO-Offload needs learner.zero_stage >= 1"),
        ([*GPU, "learner.offload=all", "learner.zero_stage=2"], r"learner.offload=all: offloading parameters needs learner.zero_stage=3, not 2"),
    ],
)
def test_offload_is_checked_against_the_learner(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


def test_offload_loads_where_it_applies():
    assert load(None, [*GPU, "learner.offload=all", "learner.zero_stage=3"]).learner.offload == "all"
    assert load(None, [*GPU, "learner.offload=optimizer", "learner.zero_stage=1"]).learner.offload == "optimizer"
