"""Judge prompt rendering for the three judge protocols: batch, pair and score; and the plain
VQA probe (`render_probe`) that asks what the image shows, without answers to judge.

All prompts follow the R1 layout of the Perception-Judge release: the system prompt asks for the
reasoning inside `<think> </think>` and the verdict inside `<answer> </answer>`. The user text is

    [Question]
    {question}

    [Assistant A's Answer]
    {answer}

    ...

with no image placeholder token: the chat template adds it from the image part of the message.

Batch protocol, two answer styles:
- `ranking`: one answer block with the letters best -> worst, e.g. `<answer>B > A > C</answer>`.
- `scores`:  one `<answer>N</answer>` per assistant in letter order, distinct integers 1-10, as in
  the released Perception-Judge prompt; the ranking is the letters sorted by score.

Pair protocol: `scores` (two scores, equal scores mean a tie) or `ranking` (one verdict letter,
`A`, `B`, or `C` for a tie). Score protocol: one integer 1-10. Every system prompt is a
constant (independent of K), so prompt prefixes stay cacheable.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence

from pjray.types import JudgeItem, JudgePrompt

# The chat format's end-of-turn token: rollout engines stop at it, and only whitespace and it may
# follow a response's final answer block.
EOS_TOKEN = "<|im_end|>"
LETTERS = string.ascii_uppercase  # letter i names the i-th shown candidate
MAX_CANDIDATES = len(LETTERS)
SCORE_MIN, SCORE_MAX = 1, 10  # the judge's own score scale in the scores style and score protocol

BATCH_STYLES = ("ranking", "scores")
PAIR_STYLES = ("ranking", "scores")
PAIR_VERDICTS = ("A", "B", "C")  # C = tie

_PREAMBLE = (
    "You are a helpful assistant. You first think through the task step by step and then give "
    "the user your answer. The reasoning and the answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> detailed reasoning here, explaining "
    "each step of your evaluation </think><answer> answer here </answer>. "
)
_CRITERIA = (
    "Check what each answer says about the image against the image itself. Criteria include "
    "helpfulness, relevance, accuracy, and level of detail. Avoid order, length, style or other "
    "bias. "
)

SYSTEM_BATCH_RANKING = (
    _PREAMBLE + "Now the user asks you to judge the answers of several AI assistants to a question about "
    "an image. "
    + _CRITERIA
    + "After thinking, when you reach a conclusion, rank all the assistants from best to worst "
    "by their letters, using every letter exactly once, within a single <answer> </answer> "
    "block, for example <answer>B > A > C</answer>"
)

SYSTEM_BATCH_SCORES = (
    _PREAMBLE + "Now the user asks you to judge the answers of several AI assistants to a question about "
    "an image. Score each assistant 1-10 (higher = better). "
    + _CRITERIA
    + "DO NOT assign the same score to multiple assistants. After thinking, when you reach a "
    "conclusion, give one score per assistant, in the order the assistants are shown, each "
    "within its own <answer> </answer> tags, for example "
    "<answer>3</answer><answer>8</answer><answer>6</answer>"
)

SYSTEM_PAIR_SCORES = (
    _PREAMBLE + "Now the user asks you to judge the answers of two AI assistants to a question about an "
    "image. Score each assistant 1-10 (higher = better). "
    + _CRITERIA
    + "After thinking, when you reach a conclusion, give the two scores, Assistant A's first, "
    "each within its own <answer> </answer> tags, for example <answer>3</answer><answer>5</answer>"
)

SYSTEM_PAIR_RANKING = (
    _PREAMBLE + "Now the user asks you to judge the answers of two AI assistants to a question about an "
    "image. " + _CRITERIA + "After thinking, when you reach a conclusion, give the letter of the better answer, or C "
    "if both are equally good, within <answer> </answer> tags, for example <answer>A</answer>"
)

SYSTEM_SCORE = (
    _PREAMBLE + "Now the user asks you to judge the answer of an AI assistant to a question about an "
    "image. Score the assistant 1-10 (higher = better). "
    + _CRITERIA
    + "After thinking, when you reach a conclusion, give the score within <answer> </answer> "
    "tags, for example <answer>7</answer>"
)

SYSTEM_PROBE = (
    "You are a helpful assistant. Look at the image and answer the question. First think "
    "briefly inside <think> </think>, then give only the short answer (a word or a short "
    "phrase) inside <answer> </answer>, for example <answer>red</answer>"
)

SYSTEM_ANSWER = (
    "You are a helpful assistant. Look at the image and answer the question about it. Reason "
    "step by step about what the image shows, then give the final answer on its own last line, "
    "for example\nFinal Answer: red"
)
# How a policy is asked to answer (task.answer_style): reasoning, then a "Final Answer:" line (the
# PPJD candidates' style, which pjray judges read), or the VQA probe's short answer block.
ANSWER_SYSTEM = {"reasoned": SYSTEM_ANSWER, "short": SYSTEM_PROBE}

_BATCH_SYSTEM = {"ranking": SYSTEM_BATCH_RANKING, "scores": SYSTEM_BATCH_SCORES}
_PAIR_SYSTEM = {"ranking": SYSTEM_PAIR_RANKING, "scores": SYSTEM_PAIR_SCORES}


def _user_text(question: str, answers: Sequence[str]) -> str:
    """The user turn: the question, then the answers under `[Assistant X's Answer]` headers."""
    parts = [f"[Question]\n{question}"]
    parts += [f"[Assistant {LETTERS[i]}'s Answer]\n{a}" for i, a in enumerate(answers)]
    return "\n\n".join(parts)


def order_from_ranking(ranking: str) -> tuple[int, ...]:
    """Letters best -> worst ("CDAB") -> candidate indices best -> worst ((2, 3, 0, 1)).

    Lets benchmark rows with a human ranking string become `JudgeItem.order`.
    """
    if len(set(ranking)) != len(ranking) or any(c not in LETTERS[: len(ranking)] for c in ranking):
        raise ValueError(f"ranking {ranking!r} is not a permutation of {LETTERS[: len(ranking)]}")
    return tuple(LETTERS.index(c) for c in ranking)


def render_batch(
    item: JudgeItem,
    rng: random.Random | None,
    style: str = "ranking",
    *,
    shuffle: bool = True,
    shown: Sequence[int] | None = None,
) -> JudgePrompt:
    """Render the batch protocol for one item, candidates shuffled by `rng` and lettered A, B, ...

    `target` is the letters best -> worst under this shuffle; `shown[i]` is the index into
    `item.candidates` shown under letter i. `shuffle=False` keeps the stored order (benchmarks
    whose truth is given in the stored letters); `shown` shows the candidates in that order (the
    training stream's balanced orders, `pjray.data.sampler.shown_order`). With either, `rng` is
    not used.
    """
    k = len(item.candidates)
    if style not in _BATCH_SYSTEM:
        raise ValueError(f"item {item.id!r}: unknown batch style {style!r}; expected one of {BATCH_STYLES}")
    if not 2 <= k <= MAX_CANDIDATES:
        raise ValueError(f"item {item.id!r}: {k} candidates; the batch protocol takes 2..{MAX_CANDIDATES}")
    if style == "scores" and k > SCORE_MAX - SCORE_MIN + 1:
        # Distinct integer scores 1-10 cannot rank more than 10 candidates.
        raise ValueError(f"item {item.id!r}: {k} candidates; the scores style takes at most 10")
    if sorted(item.order) != list(range(k)):
        raise ValueError(f"item {item.id!r}: order {item.order!r} is not a permutation of range({k})")
    if shown is not None:
        if sorted(shown) != list(range(k)):
            raise ValueError(f"item {item.id!r}: shown order {tuple(shown)!r} is not a permutation of range({k})")
        shown = list(shown)
    else:
        shown = list(range(k))
        if shuffle:
            if rng is None:
                raise ValueError(f"item {item.id!r}: shuffling the candidates needs an rng")
            rng.shuffle(shown)
    letter_of = {cand: LETTERS[pos] for pos, cand in enumerate(shown)}
    return JudgePrompt(
        item_id=item.id,
        system=_BATCH_SYSTEM[style],
        user=_user_text(item.question, [item.candidates[c] for c in shown]),
        image=item.image,
        protocol="batch",
        style=style,
        num_candidates=k,
        shown=tuple(shown),
        target="".join(letter_of[c] for c in item.order),
    )


def render_pair(
    question: str,
    image: bytes | None,
    answer_a: str,
    answer_b: str,
    *,
    item_id: str = "",
    truth: str = "",
    style: str = "scores",
    swap: bool = False,
) -> JudgePrompt:
    """Render the pair protocol from a raw benchmark row.

    `truth` is "A" (answer_a better), "B", "C" (tie), or "" when unknown; it becomes `target`.
    `swap=True` shows answer_b under letter A (for position-bias checks) and maps the target
    accordingly, so `target` always refers to the letters as shown. The default style is the
    released protocol's two scores; `ranking` asks for one verdict letter.
    """
    if style not in _PAIR_SYSTEM:
        raise ValueError(f"item {item_id!r}: unknown pair style {style!r}; expected one of {PAIR_STYLES}")
    truth = truth.strip().upper()
    if truth not in ("", *PAIR_VERDICTS):
        raise ValueError(f"item {item_id!r}: pair truth {truth!r} is not one of A, B, C (tie)")
    answers, shown = (answer_a, answer_b), (0, 1)
    if swap:
        answers, shown = (answer_b, answer_a), (1, 0)
        truth = {"A": "B", "B": "A"}.get(truth, truth)
    return JudgePrompt(
        item_id=item_id,
        system=_PAIR_SYSTEM[style],
        user=_user_text(question, answers),
        image=image,
        protocol="pair",
        style=style,
        num_candidates=2,
        shown=shown,
        target=truth,
    )


def render_score(
    question: str,
    image: bytes | None,
    answer: str,
    *,
    item_id: str = "",
    truth: int | str | None = None,
) -> JudgePrompt:
    """Render the score protocol (one answer, scored 1-10) from a raw benchmark row.

    `truth` is the benchmark's score as given (MLLM-as-a-Judge: 1-5, an int or a string such
    as "4"); `target` is its integer as a string, "" when unknown. Mapping the judge's 1-10
    onto the benchmark's scale is the evaluation's job.
    """
    target = ""
    if truth is not None and str(truth).strip() != "":
        try:
            target = str(int(str(truth).strip()))
        except ValueError:
            raise ValueError(f"item {item_id!r}: score truth {truth!r} is not an integer") from None
    return JudgePrompt(
        item_id=item_id,
        system=SYSTEM_SCORE,
        user=f"[Question]\n{question}\n\n[Assistant's Answer]\n{answer}",
        image=image,
        protocol="score",
        style="scores",
        num_candidates=1,
        shown=(0,),
        target=target,
    )


def render_probe(question: str, image: bytes | None, *, item_id: str = "") -> JudgePrompt:
    """A plain VQA prompt: the question about the image, no answers to judge (the bias
    diagnosis' probes, the base judge's perception targets)."""
    return JudgePrompt(
        item_id=item_id,
        system=SYSTEM_PROBE,
        user=question,
        image=image,
        protocol="vqa",
        style="answer",
        num_candidates=0,
        shown=(),
        target="",
    )


def render_question(
    question: str, image: bytes | None, *, item_id: str = "", reference: str = "", style: str = "reasoned"
) -> JudgePrompt:
    """A policy's prompt: the question about the image, answered in `style` (`ANSWER_SYSTEM`);
    `target` is the reference answer ("" when there is none)."""
    if style not in ANSWER_SYSTEM:
        raise ValueError(f"item {item_id!r}: unknown answer style {style!r}; expected one of {sorted(ANSWER_SYSTEM)}")
    return JudgePrompt(
        item_id=item_id,
        system=ANSWER_SYSTEM[style],
        user=question,
        image=image,
        protocol="answer",
        style=style,
        num_candidates=0,
        shown=(),
        target=reference,
    )
