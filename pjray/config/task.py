"""`task.*`: what a training run teaches: a judge (the paper) or a policy rewarded by a rule, a
judge, or both. The task changes only the prompts and how responses are rewarded."""

from __future__ import annotations

from dataclasses import dataclass

from pjray.config.fields import opt


@dataclass(frozen=True)
class TaskConfig:
    # judge: prompts are judging prompts over PPJD tuples, rewarded by format x ranking (the
    # paper). policy: prompts are (image, question) rows, the responses answers, rewarded by
    # reward.source (pjray.rl.task).
    kind: str = opt("judge", choices=("judge", "policy"))
    # policy: how the prompt asks for the answer: reasoned (steps, then a "Final Answer:" line:
    # the PPJD candidates' style, which pjray judges are trained to read) | short (the VQA probe's
    # <think>...</think><answer>...</answer>, the base judges' own VQA format).
    answer_style: str = opt("reasoned", choices=("reasoned", "short"))

    def check(self) -> None:
        pass
