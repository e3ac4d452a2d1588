"""Typed messages that cross module and actor boundaries.

Everything a Ray actor sends or receives is one of these dataclasses: never an untyped dict.
Tensor shapes are given in the field comments (B = sequences in a batch, T = padded length).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:  # annotations only: a process that never touches a tensor (a reward worker) never imports torch
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class JudgeItem:
    """One ranked tuple of the PPJD schema: an image, a question and K candidate answers.

    `candidates` may be stored in any order; `order` lists candidate indices from best to worst,
    e.g. (chosen, perception-only error, perception + reasoning error) -> order [0, 1, 2].
    """

    id: str
    image: bytes  # encoded PNG or JPEG
    question: str
    candidates: tuple[str, ...]  # K answers
    order: tuple[int, ...]  # indices into candidates, best -> worst; a permutation of range(K)
    source: str  # "scenes", "mmpr", ...
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable perturbation metadata


@dataclass(frozen=True)
class Question:
    """One row of a policy's training: an image, a question and, where known, its answer."""

    id: str
    image: bytes  # encoded PNG or JPEG
    question: str
    reference: str | None  # the correct final answer; None: no rule reward can score it
    source: str  # "scenes", or the dataset it came from
    # A scene row's `pjray.data.scenes.scene_ref` (the oracle reads the scene from it); None else.
    scene: dict[str, Any] | None = None


@dataclass(frozen=True)
class AnswerGroup:
    """A policy's G answers to one question, sent to a judge reward worker to be ranked."""

    key: str  # draws the group's call design (the same key, the same design)
    question: str
    image: bytes | None
    answers: tuple[str, ...]  # [G], as the judge is shown them


@dataclass(frozen=True)
class GroupVerdict:
    """What a judge made of one `AnswerGroup` (`pjray.reward.judging`)."""

    rewards: tuple[float, ...]  # [G] in [0, 1]
    calls: int  # judge prompts generated for the group
    unreadable: int  # of them, verdicts that could not be read
    subsets_judged: int  # subsets whose every letter rotation got a readable verdict
    subsets_consistent: int  # of them, those whose verdicts followed the answers, not the letters


@dataclass(frozen=True)
class JudgePrompt:
    """A rendered judge prompt for one item, with the candidates shuffled and lettered.

    Letter i (A, B, ...) shows `candidates[shown[i]]` of the item. `target` is the correct
    verdict: letters best -> worst ("BCA") for the batch protocol, one letter for pair, the
    score as a string for score.
    """

    item_id: str
    system: str
    user: str  # the user turn's text, without any image placeholder token
    image: bytes | None
    protocol: str  # "batch" | "pair" | "score"
    style: str  # "ranking" | "scores"
    num_candidates: int
    shown: tuple[int, ...]  # shown[i] = index into item.candidates of the answer under letter i
    target: str
    # Response text written for the judge before it generates (after the chat's opening
    # "<think>\n", when it opens one): a forced start, e.g. pjray.eval.looking.forced_prefill.
    # The engines return only what the judge wrote after it.
    prefill: str = ""


@dataclass(frozen=True)
class ChatExample:
    """One supervised example: a judge prompt and the response the judge should write."""

    prompt: JudgePrompt
    response: str  # the text after the chat's opening "<think>\n" (when it opens one), to the answer's end
    task: str = "chat"  # what the example teaches (the base judge's mixture: vqa | batch | score)
    # A character span [start, end) of `response` whose tokens the loss skips (the tokens still
    # condition what follows); None: every response token is trained.
    untrained: tuple[int, int] | None = None


@dataclass(frozen=True)
class Completion:
    """One sampled response to one prompt."""

    prompt_index: int  # index of the prompt in the list given to generate()
    sample_index: int  # 0 .. n-1 within the prompt's group
    token_ids: tuple[int, ...]  # response tokens only, [L]
    logprobs: tuple[float, ...]  # log softmax(logits / temperature) at each response token, [L]
    text: str  # decoded response (special tokens skipped)
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (hit max_new_tokens)
    # The weights it was sampled with: the training step whose update they hold (0: the
    # starting weights), stamped by the rollout worker.
    weight_version: int = 0


@dataclass(frozen=True)
class Judgment:
    """A parsed judge response. Never raises on a string: `reason` says what was wrong."""

    think: str | None
    answer: str | None  # raw text inside <answer>...</answer> (joined when several)
    ranking: str | None  # letters best -> worst, e.g. "BAC"; None when it could not be read
    scores: tuple[int, ...] | None  # per-candidate scores (scores style), in letter order
    format_ok: bool
    reason: str  # "" when format_ok, else a short human-readable reason


@dataclass(frozen=True)
class RewardResult:
    """The judge reward of one response: total = format * ranking (+ extras)."""

    total: float
    format: float  # 0.0 or 1.0
    ranking: float  # in [0, 1]; computed only when the prediction could be read, else 0
    pred: str | None  # predicted ranking string
    reason: str


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A worker's answer to one call with the seconds its work took inside the worker.

    `compute_s` is measured around the work only, so everything Ray adds to the call (dispatch,
    (de)serialising arguments and results, object-store transfers, queueing) lies outside it.
    """

    value: T
    compute_s: float

    @classmethod
    def measure(cls, fn: Callable[..., T], *args: Any) -> Timed[T]:
        """Call `fn(*args)` and time it with `time.perf_counter`."""
        start = time.perf_counter()
        value = fn(*args)
        return cls(value, time.perf_counter() - start)


@dataclass(frozen=True)
class Experience:
    """One prompt + sampled response, as the driver sends it to a learner rank.

    The learner builds model inputs from `prompt_text` and `image` with its own processor (the
    same expansion of image tokens the rollout used), then appends `response_ids`.
    """

    prompt_text: str  # the chat-rendered prompt (render_chat), one un-expanded image placeholder
    image: bytes | None
    response_ids: tuple[int, ...]  # [L]
    advantage: float
    old_logprobs: tuple[float, ...] | None = None  # [L]; None: take the current policy's (on-policy)
    ref_logprobs: tuple[float, ...] | None = None  # [L]; None when the KL term is off
    # [L]; the rollout engine's own log-probs (Completion.logprobs), to measure how far the
    # learner's differ; None: not measured in this update.
    rollout_logprobs: tuple[float, ...] | None = None
    # [L]; False on response tokens the loss skips (a supervised target's untrained span); None:
    # every response token is trained.
    loss_mask: tuple[bool, ...] | None = None


@dataclass
class TrainBatch:
    """What the learner needs for one GRPO update of B sequences (prompt + response).

    Images are kept per sequence, as the judge family's processor lays one prompt's out
    (`pjray.models.families.Family.row_vision`; for Qwen-VL pixel_values [patches, D] and
    image_grid_thw [n_images, 3]); the learner joins them for the micro-batch it runs.
    """

    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_token_id
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    response_mask: torch.Tensor  # [B, T] float, 1 on response tokens that are trained on
    old_logprobs: torch.Tensor  # [B, T] float, logprob of token t under the rollout policy (0 off-mask)
    advantages: torch.Tensor  # [B] float, one per sequence (broadcast over its tokens)
    vision: list[dict[str, torch.Tensor]]  # per sequence, its image tensors ({} without an image)
    ref_logprobs: torch.Tensor | None = None  # [B, T] float, filled by the learner when KL is on
    rollout_logprobs: torch.Tensor | None = None  # [B, T] float, the rollout engine's (NaN where none)
    # [B] long: prompt tokens at the start of each row (its response follows them).
    prompt_lens: torch.Tensor | None = None
    # [B] long: the first row with the same prompt text and image (GRPO's group samples share
    # one prompt), so the prompt can be forwarded once for all of them.
    prompt_group: torch.Tensor | None = None


@dataclass(frozen=True)
class TrainInputs:
    """What a training reads, resolved before the trainer starts (`pjray.recipes.training`)."""

    model: str  # the model to train (a judge, or a policy): an HF directory or a hub id
    # The training rows: a PPJD parquet file or folder, or the dataset (data.source=hf); "" for a
    # policy's scenes (made from data.* as they are read).
    items: str
    base_judge: bool  # `model` is a base judge of pjray's recipes (the held-out check compares against it)
    judge: str = ""  # task.kind=policy with a judge reward: the judge (an HF directory or a hub id)
