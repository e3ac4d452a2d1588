"""The collection of a step's groups (`pjray.rl.collect`): dynamic sampling (algo.filter_zero_std),
refill sizes, reward metrics over every generated response, and the prefilter (algo.prefilter_zero_std)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pjray.config import ConfigError, load
from pjray.console import PREFILTERED
from pjray.data.sources import Rows
from pjray.rl.collect import (
    MAX_REFILL_FACTOR,
    Batch,
    Collector,
    Round,
    prefiltered,
    refill_size,
    rollout_metrics,
    zero_variance_items,
)
from pjray.rl.items import prefilter
from pjray.rl.timer import Timer
from pjray.types import Completion, JudgePrompt, RewardResult, Timed


def test_refill_size():
    assert refill_size(8, 0, 0) == 8  # the first round asks for the step's groups
    assert refill_size(6, 2, 8) == 24  # 2 of 8 kept: 6 more needs about 24
    assert refill_size(3, 5, 6) == 4  # ceil(3 * 6 / 5)
    assert refill_size(6, 1, 8) == 6 * MAX_REFILL_FACTOR  # capped
    assert refill_size(6, 0, 8) == 6 * MAX_REFILL_FACTOR  # nothing kept yet


class ScriptedCollector(Collector):
    """A collector whose generation and reward are scripted: group g of the whole stream has
    reward variance iff `varied(g)`; a varied group scores 1 on its first sample and every other response 0.5."""

    def __init__(self, cfg, varied):
        super().__init__(cfg, sampler=SimpleNamespace(state=None), processor=None, rollout=None, task=None)
        self.varied = varied
        self.generated: list[int] = []

    def generate(self, num_prompts, seed, timer):
        first = sum(self.generated)
        self.generated.append(num_prompts)
        n = self.cfg.algo.group_size
        prompts = [
            JudgePrompt(f"g{first + i}", "s", "u", None, "batch", "ranking", 3, (0, 1, 2), "ABC")
            for i in range(num_prompts)
        ]
        completions = [Completion(p, s, (1,), (0.0,), "x", "stop") for p in range(num_prompts) for s in range(n)]
        return Round(prompts, ["t"] * num_prompts), completions, []

    def submit_batch(self, step):
        """A step's first round, scripted like the refills (`generate`)."""
        r, completions, _ = self.generate(self.cfg.trainer.prompts_per_step, step * 1_000, None)
        return Batch(step, self.sampler.state, r, SimpleNamespace(result=lambda: Timed(completions, 0.0)))

    def score(self, prompts, texts, completions, timer):
        out = []
        for c in completions:
            g = int(prompts[c.prompt_index].item_id[1:])
            total = 1.0 if self.varied(g) and c.sample_index == 0 else 0.5
            out.append(RewardResult(total, 1.0, total, "ABC", ""))
        return out


def config(filter_zero_std: bool, rounds: int = 2):
    return load(
        None,
        [
            "trainer.prompts_per_step=8",
            "algo.group_size=4",
            f"algo.filter_zero_std={str(filter_zero_std).lower()}",
            f"algo.max_refill_rounds={rounds}",
        ],
    )


def test_before_a_sync_the_contrast_generations_in_flight_are_waited_for_too():
    """With trainer.max_staleness, a weight sync waits for every generation queued before it on
    the workers (`Collector.wait_for_generation`): a step's responses and, with
    algo.contrast_responses, its responses on the contrast images."""
    waited: list[str] = []

    def pending(name):
        return SimpleNamespace(wait_finished=lambda: waited.append(name))

    collector = Collector(config(False), sampler=None, processor=None, rollout=None, task=None)
    r = Round([], [])
    collector.in_flight.extend(
        [
            Batch(1, None, r, pending("step 1"), pending("step 1 contrast")),
            Batch(2, None, r, pending("step 2")),
        ]
    )
    collector.wait_for_generation()
    assert waited == ["step 1", "step 1 contrast", "step 2"]


def test_dynamic_sampling_keeps_varied_groups_and_measures_every_response():
    collector = ScriptedCollector(config(True), varied=lambda g: g % 4 == 0)  # 1 group in 4 has signal
    rollouts = collector.collect(1, Timer())
    # 8 -> 2 kept; 6 more at a keep rate of 1/4: 24 prompts -> 6 kept; full after one refill.
    assert collector.generated == [8, 24]
    assert [p.item_id for p in rollouts.prompts] == [f"g{g}" for g in range(0, 32, 4)]
    assert len(rollouts.completions) == len(rollouts.rewards) == 8 * 4
    assert len(rollouts.seen) == 32 * 4 and rollouts.groups_seen == 32
    assert rollouts.frac_zero_std == pytest.approx(24 / 32)
    metrics = rollout_metrics(rollouts, torch.zeros(32), group_size=4)
    # The policy's reward is the mean over all 128 responses; the kept groups' is higher.
    assert metrics["reward/mean"] == pytest.approx((8 * 1.0 + 120 * 0.5) / 128)
    assert metrics["reward/kept_mean"] == pytest.approx((8 * 1.0 + 24 * 0.5) / 32)


def test_dynamic_sampling_stops_after_its_refill_rounds():
    collector = ScriptedCollector(config(True, rounds=1), varied=lambda g: g == 3)
    rollouts = collector.collect(1, Timer())
    assert collector.generated == [8, 7 * MAX_REFILL_FACTOR]  # 1 of 8 kept: 7 more, capped
    assert [p.item_id for p in rollouts.prompts] == ["g3"]


def test_without_filtering_every_group_is_kept():
    collector = ScriptedCollector(config(False), varied=lambda g: g % 4 == 0)
    rollouts = collector.collect(1, Timer())
    assert collector.generated == [8]
    assert len(rollouts.prompts) == 8 and len(rollouts.seen) == len(rollouts.rewards) == 32
    metrics = rollout_metrics(rollouts, torch.zeros(32), group_size=4)
    assert metrics["reward/mean"] == metrics["reward/kept_mean"]


def test_the_prefilter_lists_the_items_whose_group_earns_one_reward():
    # 10 items in rounds of 8: the last round holds 2; every third group has reward variance.
    collector = ScriptedCollector(config(False), varied=lambda g: g % 3 == 0)
    flat = zero_variance_items(collector, 10)
    assert collector.generated == [8, 2]
    assert flat == {f"g{g}": 0.5 for g in range(10) if g % 3}


def test_the_prefilter_names_a_counterfactual_pair_by_its_first_prompt():
    cfg = load(None, ["trainer.prompts_per_step=4", "algo.group_size=4", "data.counterfactual_pairs=true"])

    class Pairs(ScriptedCollector):
        def generate(self, num_prompts, seed, timer):
            # Two prompts a group (the item, then its swap), two responses each.
            first = sum(self.generated)
            self.generated.append(num_prompts)
            prompts = [
                JudgePrompt(f"{tag}{first + i}", "s", "u", None, "batch", "ranking", 3, (0, 1, 2), "ABC")
                for i in range(num_prompts)
                for tag in ("g", "s")
            ]
            completions = [
                Completion(p, s, (1,), (0.0,), "x", "stop") for p in range(2 * num_prompts) for s in range(2)
            ]
            return Round(prompts, ["t"] * len(prompts)), completions, []

        def score(self, prompts, texts, completions, timer):
            # Group 1's swapped prompt earns more: the group varies only through its second half.
            return [
                RewardResult(v, 1.0, v, "ABC", "")
                for c in completions
                for v in [1.0 if prompts[c.prompt_index].item_id == "s1" else 0.5]
            ]

    collector = Pairs(cfg, varied=None)
    assert zero_variance_items(collector, 3) == {"g0": 0.5, "g2": 0.5}
    assert collector.generated == [3]


def test_the_prefilter_keeps_every_item_when_it_would_leave_none():
    items = [SimpleNamespace(id=f"g{g}") for g in range(4)]
    assert [it.id for it in prefiltered(items, {"g1": 0.5, "g3": 0.5})] == ["g0", "g2"]
    assert prefiltered(items, {f"g{g}": 0.0 for g in range(4)}) == items  # a judge that never earns a reward


def test_a_resumed_run_reads_the_prefilters_list_and_one_without_a_list_is_refused(tmp_path):
    data = Rows("x", [SimpleNamespace(id=f"g{g}") for g in range(4)])
    on, off = load(None, []), load(None, ["algo.prefilter_zero_std=false"])
    assert on.algo.prefilter_zero_std and prefilter(data, off, tmp_path, True, None, None, None) is data
    with pytest.raises(ConfigError, match="started without the prefilter"):
        prefilter(data, on, tmp_path, True, None, None, None)
    (tmp_path / PREFILTERED).write_text("".join(json.dumps({"id": i, "reward": 1.0}) + "\n" for i in ("g0", "g2")))
    assert [it.id for it in prefilter(data, on, tmp_path, True, None, None, None).rows] == ["g1", "g3"]
