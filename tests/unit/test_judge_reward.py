"""A judge as a policy's reward: the call design, verdicts to rewards (hand-computed numbers), and
the judge reward worker behind a scripted judge (a fake engine, named as such: it answers each
prompt by a known rule, so the rewards it must give are known exactly)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter

import pytest

from pjray.config import ConfigError, JudgeRewardConfig, ModelConfig, load
from pjray.data.prompts import LETTERS
from pjray.data.scenes import sample_qa
from pjray.reward.answer import answer_of, answer_reward, shown_answer
from pjray.reward.judging import (
    borda,
    calls,
    fill_unread,
    group_rewards,
    kendall_tau,
    plackett_luce,
    position_consistency,
    subsets,
    verdict_points,
)
from pjray.rollout.judge_worker import JudgeRewardWorker
from pjray.types import AnswerGroup, Completion, JudgePrompt
from tests.support.images import noisy_png

# --------------------------------------------------------------------------- the call design


def test_each_round_shows_every_answer_once_and_every_letter_equally():
    design = subsets(6, 3, rounds=2, key="g")
    assert len(design) == 4 and all(len(s) == 3 for s in design)
    for r in range(2):
        assert sorted(a for s in design[2 * r : 2 * r + 2] for a in s) == list(range(6))
    shown = calls(design)
    assert len(shown) == 12  # rounds x G/K subsets x K rotations
    # Every answer under every letter exactly once per round.
    per_letter = Counter((a, letter) for call in shown for letter, a in enumerate(call))
    assert set(per_letter.values()) == {2} and len(per_letter) == 18
    assert subsets(6, 3, 2, "g") == design and subsets(6, 3, 2, "h") != design


def test_a_group_that_k_does_not_divide_fills_its_last_subset_with_other_answers():
    design = subsets(4, 3, rounds=1, key="x")
    assert len(design) == 2
    assert set(design[0]) | set(design[1]) == {0, 1, 2, 3}
    assert len(set(design[1])) == 3  # the filler answers differ from the one left over


# --------------------------------------------------------------------------- verdicts to rewards


def test_verdict_points_by_protocol():
    assert verdict_points("ranking", "BCA", 3) == (0.0, 1.0, 0.5)
    assert verdict_points("ranking", "BA", 2) == (0.0, 1.0)
    assert verdict_points("ranking", "BB", 2) is None  # not a permutation of the letters
    assert verdict_points("ranking", None, 3) is None
    assert verdict_points("pair", "A", 2) == (1.0, 0.0)
    assert verdict_points("pair", "C", 2) == (0.5, 0.5)
    assert verdict_points("score", 10, 1) == (1.0,)
    assert verdict_points("score", 4, 1) == (pytest.approx(1 / 3),)
    assert verdict_points("score", 11, 1) is None


def test_borda_is_the_mean_normalised_rank_over_readable_calls():
    shown = [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    points = [(1.0, 0.5, 0.0), None, (0.0, 1.0, 0.5)]  # call 2 unreadable
    # answer 0: 1.0 and 1.0; answer 1: 0.5 and 0.5; answer 2: 0.0 and 0.0
    assert borda(3, shown, points) == [1.0, 0.5, 0.0]
    assert borda(4, shown, points)[3] is None
    assert fill_unread([1.0, None, 0.0]) == [1.0, 0.5, 0.0]
    assert fill_unread([None, None]) == [0.5, 0.5]


def test_bradley_terry_orders_pairs_and_counts_a_tie_as_half_a_win():
    # 0 beats 1 in both orders; 1 and 2 tie in both orders.
    shown = [(0, 1), (1, 0), (1, 2), (2, 1)]
    points = [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.5, 0.5)]
    r = plackett_luce(3, shown, points)
    # 2 tied with 1, who lost to 0: a strength between theirs.
    assert r[0] > r[2] > r[1]
    # Two answers only, one beating the other in both orders: the strengths under the prior
    # (a half win against a strength-1 answer each) solve w0 = 2.5 / (2/(w0+w1) + 1/(w0+1)).
    r = plackett_luce(2, [(0, 1), (1, 0)], [(1.0, 0.0), (0.0, 1.0)])
    assert r[0] + r[1] == pytest.approx(1.0)
    assert 0.75 < r[0] < 0.95


def test_plackett_luce_keeps_a_consistent_ranking_order():
    shown = calls([(0, 1, 2)])
    # The judge ranks 2 > 0 > 1 under every rotation.
    points = []
    for call in shown:
        value = {2: 1.0, 0: 0.5, 1: 0.0}
        points.append(tuple(value[a] for a in call))
    r = plackett_luce(3, shown, points)
    assert r[2] > r[0] > r[1]
    assert group_rewards("ranking", "borda", 3, shown, points) == [0.5, 0.0, 1.0]


def test_position_consistency_is_per_subset_over_its_rotations():
    shown = calls([(0, 1), (2, 3)])
    follows_answers = [(1.0, 0.0), (0.0, 1.0)]  # 0 beats 1 in both orders
    follows_letters = [(1.0, 0.0), (1.0, 0.0)]  # A wins whatever A shows
    assert position_consistency(shown, follows_answers + follows_letters) == (1, 2)
    assert position_consistency(shown, follows_answers + [(1.0, 0.0), None]) == (1, 1)


def test_kendall_tau_hand_values():
    assert kendall_tau([1, 2, 3], [1, 2, 3]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    # pairs: (0,1) concordant, (0,2) concordant, (1,2) tied in b: tau-b = 2 / sqrt(3 * 2)
    assert kendall_tau([1, 2, 3], [0, 1, 1]) == pytest.approx(2 / 6**0.5)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None


# --------------------------------------------------------------------------- the rule reward


def test_answer_reward_checks_the_final_and_the_stated_facts():
    qa = sample_qa(3, 96, "color", 1, 1)
    scene = {"seed": 3, "image_size": 96, "objects": [1, 1], "kind": "color"}
    right = answer_reward(qa.answer, qa.final, scene)
    assert (right.total, right.format, right.pred) == (1.0, 1.0, qa.final)
    wrong_final = qa.answer.rsplit("\n", 1)[0] + "\nFinal Answer: not-a-colour"
    assert answer_reward(wrong_final, qa.final, scene).total == 0.0
    # A right final reached by stating a wrong size: the oracle says wrong.
    size = qa.scene.objects[0].size
    other = "small" if size != "small" else "large"
    misread = qa.answer.replace(f"It is a {size}", f"It is a {other}")
    result = answer_reward(misread, qa.final, scene)
    assert result.total == 0.0 and f"size={other}" in result.reason
    assert answer_reward("no answer here", qa.final, scene).format == 0.0
    cut = answer_reward(qa.answer, qa.final, scene, truncated=True)
    assert (cut.total, cut.format) == (0.0, 0.0)
    assert answer_reward("<think>x</think><answer>Blue.</answer>", "blue").total == 1.0
    assert answer_reward(qa.answer, None).total == 0.0  # no reference: only the format


def test_shown_answer_writes_an_answer_block_as_a_final_answer_line():
    assert shown_answer("Image: red.\n</think>\n<answer>red</answer>") == "Image: red.\nFinal Answer: red"
    assert shown_answer("Steps.\nFinal Answer: red") == "Steps.\nFinal Answer: red"
    assert answer_of("no final") is None


# --------------------------------------------------------------------------- the worker


class ScriptedJudge:
    """A fake engine (the `RolloutEngine.generate` interface only): it reads the answers a judge
    prompt shows and answers as `verdict(answers)` says, in the judge format."""

    def __init__(self, verdict):
        self.verdict = verdict
        self.generate_calls: list[int] = []

    def generate(self, prompts: list[JudgePrompt], n: int, seed: int) -> list[Completion]:
        self.generate_calls.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            answers = re.findall(r"'s Answer\]\n(.*?)(?=\n\n\[Assistant|\Z)", p.user, re.DOTALL)
            text = f"looked</think><answer>{self.verdict(p, answers)}</answer>"
            out.append(Completion(i, 0, (1,), (0.0,), text, "stop"))
        return out


def quality(answer: str) -> int:
    return int(re.search(r"quality (\d+)", answer).group(1))


def by_quality(prompt: JudgePrompt, answers: list[str]) -> str:
    """The known order: higher number, better answer."""
    if prompt.protocol == "score":
        return str(quality(answers[0]) + 1)
    ranked = sorted(range(len(answers)), key=lambda i: -quality(answers[i]))
    if prompt.protocol == "pair":
        return LETTERS[ranked[0]]
    return " > ".join(LETTERS[i] for i in ranked)


def worker(verdict, tmp_judge, **cfg) -> JudgeRewardWorker:
    return JudgeRewardWorker(JudgeRewardConfig(**cfg), str(tmp_judge), ModelConfig(), engine=ScriptedJudge(verdict))


@pytest.fixture(scope="module")
def tmp_judge(tmp_path_factory):
    """A tiny judge's directory: the worker reads its processor (the chat template)."""
    from pjray.models.tiny import build_tiny_judge

    path = tmp_path_factory.mktemp("judge") / "judge"
    build_tiny_judge(path, arch="qwen2_vl", seed=0)
    return path


def group(n: int, key: str = "q") -> AnswerGroup:
    return AnswerGroup(key, "What colour?", noisy_png(32, 32, 0), tuple(f"Final Answer: quality {q}" for q in range(n)))


def test_a_judge_with_a_known_order_gives_the_exact_rewards(tmp_judge):
    ranking = worker(by_quality, tmp_judge).judge([group(3)], seed=0)[0]
    assert ranking.rewards == (0.0, 0.5, 1.0)
    assert (ranking.calls, ranking.unreadable, ranking.subsets_judged, ranking.subsets_consistent) == (3, 0, 1, 1)
    score = worker(by_quality, tmp_judge, protocol="score", rounds=2).judge([group(4)], seed=0)[0]
    assert score.rewards == pytest.approx((0.0, 1 / 9, 2 / 9, 3 / 9))
    assert score.calls == 8 and score.subsets_judged == 0
    pair = worker(by_quality, tmp_judge, protocol="pair", rounds=9).judge([group(4)], seed=0)[0]
    assert list(pair.rewards) == sorted(pair.rewards) and pair.subsets_consistent == pair.subsets_judged == 18
    pl = worker(by_quality, tmp_judge, aggregate="plackett_luce", rounds=2).judge([group(6)], seed=0)[0]
    assert pl.rewards[5] > pl.rewards[0]


def test_a_judge_that_always_answers_a_gives_equal_rewards_and_no_consistency(tmp_judge):
    def always_a(prompt, answers):
        return "A" if prompt.protocol == "pair" else " > ".join(LETTERS[: len(answers)])

    for protocol, size in (("ranking", 6), ("ranking", 5), ("pair", 4)):
        verdicts = worker(always_a, tmp_judge, protocol=protocol, rounds=2).judge(
            [group(size, "a"), group(size, "b")], seed=0
        )
        for v in verdicts:
            assert v.rewards == pytest.approx((0.5,) * size), protocol
            assert v.subsets_judged > 0 and v.subsets_consistent == 0


def test_unreadable_verdicts_are_counted_and_their_answers_get_the_group_mean(tmp_judge):
    def unreadable_with_answer_0(prompt, answers):
        return "no verdict" if any(quality(a) == 0 for a in answers) else by_quality(prompt, answers)

    v = worker(unreadable_with_answer_0, tmp_judge, num_candidates=2).judge([group(4)], seed=0)[0]
    assert v.unreadable == 2  # both rotations of answer 0's subset
    readable = [r for i, r in enumerate(v.rewards) if i != 0 and r is not None]
    others = [v.rewards[i] for i in range(4)]
    # Answer 0 and its subset partner earned nothing: each gets the mean of the two others.
    partner = next(i for i in range(1, 4) if others.count(others[i]) == 2 and i != 0)
    assert v.rewards[0] == v.rewards[partner] == pytest.approx(0.5)
    assert len(readable) == 3


def test_copies_of_an_answer_share_a_reward_and_are_never_ranked_against_each_other(tmp_judge):
    def no_copies(prompt, answers):
        assert len(set(answers)) == len(answers), answers
        return by_quality(prompt, answers)

    answers = (
        "Final Answer: quality 1",
        "Final Answer: quality 0",
        "Final Answer: quality 1",
        "Final Answer: quality 2",
    )
    v = worker(no_copies, tmp_judge).judge([AnswerGroup("d", "?", None, answers)], seed=0)[0]
    assert v.rewards == (0.5, 0.0, 0.5, 1.0) and v.calls == 3  # three distinct answers, one subset
    two = worker(no_copies, tmp_judge).judge([AnswerGroup("e", "?", None, answers[:3])], seed=0)[0]
    assert two.rewards == (1.0, 0.0, 1.0) and two.calls == 2  # two distinct: pairs under K = 3
    same = worker(no_copies, tmp_judge).judge([AnswerGroup("f", "?", None, answers[:1] * 4)], seed=0)[0]
    assert same.rewards == (0.5,) * 4 and same.calls == 0


def test_every_group_of_a_step_goes_to_the_engine_in_one_generate(tmp_judge):
    w = worker(by_quality, tmp_judge, rounds=2)
    w.judge([group(6, str(i)) for i in range(5)], seed=0)
    assert w.engine.generate_calls == [5 * 12] and w.engine_calls() == 1


# --------------------------------------------------------------------------- config


def test_policy_reward_keys_and_judge_only_features_fail_with_their_key():
    with pytest.raises(ConfigError, match=r"^reward.source: only read when task.kind=policy"):
        load(overrides=["reward.source=judge"])
    policy = ["task.kind=policy", "algo.prefilter_zero_std=false"]
    with pytest.raises(ConfigError, match=r"^data.counterfactual_pairs: not with task.kind=policy"):
        load(overrides=[*policy, "data.counterfactual_pairs=true", "data.scene_kinds=[color]"])
    with pytest.raises(ConfigError, match=r"^data.source=parquet reads PPJD tuples"):
        load(overrides=[*policy, "data.source=parquet", "data.path=x"])
    with pytest.raises(ConfigError, match=r"^reward.judge.max_calls_per_step=10: a step needs 72 judge calls"):
        load(overrides=[*policy, "reward.source=judge", "reward.judge.max_calls_per_step=10"])
    with pytest.raises(ConfigError, match=r"^reward.judge.aggregate=plackett_luce: only the ranking protocol"):
        load(
            overrides=[
                *policy,
                "reward.source=judge",
                "reward.judge.protocol=pair",
                "reward.judge.aggregate=plackett_luce",
            ]
        )
    with pytest.raises(ConfigError, match=r"^reward.judge.colocate: judge worker i shares rollout worker i"):
        load(overrides=[*policy, "reward.source=judge", "reward.judge.colocate=true"])
    cfg = load(overrides=[*policy, "reward.source=mix"])
    assert cfg.reward.judge.calls_per_group(cfg.algo.group_size) == 9  # ceil(8 / 3) subsets x 3 rotations


def test_calls_per_group_matches_the_design():
    for protocol, size, rounds in itertools.product(("ranking", "pair", "score"), (3, 5, 8), (1, 3)):
        j = JudgeRewardConfig(protocol=protocol, rounds=rounds)
        assert j.calls_per_group(size) == len(calls(subsets(size, j.subset_size, rounds, "k")))


# --------------------------------------------------------------------------- the policy task


class InProcessPool:
    """Stands in for a Ray `WorkerPool` of real worker objects: `call` runs each worker's method
    in this process (the task's arithmetic is under test, not Ray)."""

    def __init__(self, *workers):
        self.workers, self.actors, self.restarts = list(workers), [], 0

    def __len__(self):
        return len(self.workers)

    def call(self, method, per_worker_args):
        return [getattr(w, method)(*args) for w, args in zip(self.workers, per_worker_args)]


def policy_task(tmp_judge, *overrides):
    from pjray.reward.workers import RewardWorker
    from pjray.rl.task import PolicyTask

    cfg = load(
        overrides=[
            "task.kind=policy",
            "data.num_items=4",
            "algo.group_size=3",
            "learner.micro_batch_size=12",
            *overrides,
        ]
    )
    task = PolicyTask(cfg)
    rows = task.rows(None).rows
    judge = JudgeRewardWorker(cfg.reward.judge, str(tmp_judge), ModelConfig(), engine=ScriptedJudge(by_quality))
    task.pools = {"reward": InProcessPool(RewardWorker(cfg.reward, 64)), "judge": InProcessPool(judge)}
    return task, rows


def answers_for(row, right: list[bool]) -> list[Completion]:
    """Three answers to `row` whose judge quality is their index; `right[i]`: the final is the reference."""
    out = []
    for i, ok in enumerate(right):
        final = row.reference if ok else "nothing"
        out.append(Completion(0, i, (1,), (0.0,), f"Step quality {i}.\nFinal Answer: {final}", "stop"))
    return out


def test_the_policy_task_mixes_the_rule_and_the_judge_and_logs_their_agreement(tmp_judge):
    from pjray.rl.timer import Timer

    task, rows = policy_task(tmp_judge, "reward.source=mix", "reward.judge_weight=0.25")
    prompt = task.prompts(0, rows[0])[0]
    # The judge prefers higher quality (answer 2), the rule the answers with the right final (0 and 2).
    results = task.score([prompt], ["t"], answers_for(rows[0], [True, False, True]), Timer())
    rule, judge = [1.0, 0.0, 1.0], [0.0, 0.5, 1.0]
    assert [r.total for r in results] == pytest.approx([0.75 * a + 0.25 * b for a, b in zip(rule, judge)])
    m = task.metrics({"step": 2.0, "judge": 0.5})
    assert m["judge/calls"] == 3 and m["judge/unreadable"] == 0.0 and m["judge/time_share"] == 0.25
    assert m["judge/oracle_agreement"] == pytest.approx(kendall_tau(judge, rule))
    assert m["reward/rule_mean"] == pytest.approx(2 / 3) and m["reward/judge_mean"] == pytest.approx(0.5)
    assert task.metrics({"step": 1.0}) == {"judge/time_share": 0.0}  # the sums start again


def test_the_shuffled_control_permutes_each_groups_judge_rewards(tmp_judge):
    from pjray.rl.timer import Timer

    plain, rows = policy_task(tmp_judge, "reward.source=judge")
    shuffled, _ = policy_task(tmp_judge, "reward.source=judge", "reward.judge.shuffle_rewards=true")
    prompts = [plain.prompts(i, rows[i])[0] for i in range(4)]
    completions = [
        dataclasses.replace(c, prompt_index=g) for g in range(4) for c in answers_for(rows[g], [True, True, True])
    ]
    a = [r.total for r in plain.score(prompts, ["t"] * 4, completions, Timer())]
    b = [r.total for r in shuffled.score(prompts, ["t"] * 4, completions, Timer())]
    assert a == [0.0, 0.5, 1.0] * 4
    assert a != b and all(sorted(b[3 * g : 3 * g + 3]) == [0.0, 0.5, 1.0] for g in range(4))
