"""The base policy's examples and a policy's held-out verdicts (no model: texts written here)."""

from __future__ import annotations

from collections import Counter

import pytest

from pjray.config import ConfigError, load
from pjray.data.scenes import COLORS, answer_text, compose_answer, true_view
from pjray.eval.policy import UNTAUGHT, answer_verdicts, hallucinated, held_out_questions, summarize
from pjray.recipes.base_policy import BasePolicyRecipe, misread, policy_examples
from pjray.reward.answer import answer_reward
from pjray.types import Completion


def test_the_base_policys_examples_misread_the_colour_at_the_recipes_rate():
    recipe = BasePolicyRecipe(scenes=600)
    examples = policy_examples(recipe)
    assert len(examples) == 600 and Counter(e.prompt.protocol for e in examples) == {"answer": 600}
    finals = Counter()
    for e in examples:
        kind = "color" if e.prompt.user.startswith("What color") else "size"
        right = answer_reward(e.response, e.prompt.target).total == 1.0
        finals[(kind, right)] += 1
    # Colour questions: the final follows the misread colour; size questions keep their final.
    assert finals[("size", False)] == 0
    share = finals[("color", True)] / (finals[("color", True)] + finals[("color", False)])
    assert abs(share - recipe.correct) < 0.07
    assert policy_examples(recipe) == examples  # a pure function of the recipe


def test_held_out_questions_are_balanced_and_held_out():
    qas = held_out_questions(2, ("color", "size"))
    cells = Counter((qa.kind, qa.scene.objects[0].color) for qa in qas)
    assert set(cells.values()) == {2} and len(cells) == 2 * len(COLORS)
    train = {e.prompt.item_id for e in policy_examples(BasePolicyRecipe(scenes=200))}
    assert not train & {f"policy-{qa.scene.seed}" for qa in qas}


class Scripted:
    """A fake engine: answers question i with `texts[i]` (one sample)."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompts, n, seed):
        return [Completion(i, 0, (1,), (0.0,), self.texts[i], "stop") for i in range(len(prompts))]


def test_verdicts_tell_right_correct_and_hallucinated_answers_apart():
    qas = [qa for qa in held_out_questions(1, ("color",)) if qa.scene.objects[0].color in UNTAUGHT][:1]
    qa = qas[0]
    truth = qa.scene.objects[0].color
    other = next(c for c in COLORS if c != truth)
    view = true_view(qa.scene)
    wrong = answer_text(*compose_answer(qa.spec, misread(view, 0, other)))
    size = qa.scene.objects[0].size
    wrong_size = qa.answer.replace(f"It is a {size}", f"It is a {'small' if size != 'small' else 'large'}")
    texts = [qa.answer, wrong, wrong_size, "I cannot tell."]
    rows = answer_verdicts(Scripted(texts), [qa] * 4, 1, seed=0)
    got = [(r["right"], r["correct"], r["hallucinated"], r["format"]) for r in rows]
    assert got == [
        (True, True, False, True),
        (False, False, True, True),
        (True, False, False, True),
        (False, False, False, False),
    ]
    assert hallucinated(qa, wrong, other)
    s = summarize(rows)
    assert s["right/untaught"] == 0.5 and s["correct/all"] == 0.25 and s["hallucinated"] == 0.25 and s["format"] == 0.75


def test_the_base_policy_is_a_policy_to_train():
    with pytest.raises(ConfigError, match=r"^model.init=base_policy: a policy to train"):
        load(overrides=["model.init=base_policy"])
    assert load(overrides=["model.init=base_policy", "task.kind=policy"]).model.init == "base_policy"
