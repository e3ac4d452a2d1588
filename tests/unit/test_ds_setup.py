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
    tuned = ds_config(
        dataclasses.replace(base, offload="all"), 2, 2, {"zero_optimization": {"offload_param": {"pin_memory": False}}}
    )
    assert tuned["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.offload=optimizer"], r"learner.offload=optimizer: the ranks run on CPU"),
        (
            [*GPU, "learner.offload=optimizer", "learner.zero_stage=0"],
            r"learner.offload=optimizer: ZeRO-Offload needs learner.zero_stage >= 1",
        ),
        (
            [*GPU, "learner.offload=all", "learner.zero_stage=2"],
            r"learner.offload=all: offloading parameters needs learner.zero_stage=3, not 2",
        ),
    ],
)
def test_offload_is_checked_against_the_learner(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


def test_offload_loads_where_it_applies():
    assert load(None, [*GPU, "learner.offload=all", "learner.zero_stage=3"]).learner.offload == "all"
    assert load(None, [*GPU, "learner.offload=optimizer", "learner.zero_stage=1"]).learner.offload == "optimizer"


def test_learner_ds_config_reaches_deepspeed_and_cannot_set_the_batch():
    """learner.ds_config is merged into the policy's DeepSpeed config (deep, after pjray's own
    keys, before a caller's overrides); the batch sizes stay pjray's."""
    cfg = load(
        overrides=[
            "learner.ds_config.zero_optimization.reduce_bucket_size=500000000",
            "learner.ds_config.gradient_clipping=0.5",
        ]
    )
    merged = ds_config(cfg.learner, grad_accum_steps=2, world_size=1, overrides={})
    assert merged["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 500000000}
    assert merged["gradient_clipping"] == 0.5 and merged["train_batch_size"] == cfg.learner.micro_batch_size * 2
    last = ds_config(cfg.learner, 2, 1, {"gradient_clipping": 2.0})
    assert last["gradient_clipping"] == 2.0
    with pytest.raises(ConfigError, match=r"learner.ds_config: \['gradient_accumulation_steps'\] are set from"):
        load(overrides=["learner.ds_config.gradient_accumulation_steps=4"])


def test_a_sharded_reference_is_a_zero3_engine_whatever_the_policys_stage():
    policy = ds_config(LearnerConfig(micro_batch_size=4, zero_stage=2), 2, 4, {})
    assert ref_ds_config(policy, LearnerConfig(micro_batch_size=4), world_size=4)["zero_optimization"] == {"stage": 3}
