"""Parse judge responses into `Judgment`s. No function here raises on any response text.

Format (all protocols): exactly one `<think> ... </think>` block, and the answer block(s) after
its `</think>`. With `think_prefilled=True` the prompt already ended in "<think>\\n", so the text
must have no `<think>` of its own and exactly one `</think>`. Tags are matched exactly (lower
case, no spaces inside the brackets). Text before the blocks is not policed, but only whitespace
(and the end-of-turn token) may follow the final `</answer>`: a response that runs on after its
verdict is not well formed, so its filler is never rewarded. An `<answer>` tag
inside the reasoning counts as an answer block (as in the released reward, which reads every
`<answer>` in the response).

Batch, `ranking` style: exactly one answer block holding a permutation of the K letters. Accepted
spellings, with any whitespace around tokens and separators:

    B > A > C    B>A>C    BAC    B A C    B, A, C    [[B]], [[A]], [[C]]    B ≻ A ≻ C

i.e. upper-case letters, each optionally written `[[X]]`, separated by `>`, `≻`, `,`,
whitespace or nothing. Lower-case letters, `<`, numbering and prose are not read.

Batch, `scores` style: exactly K answer blocks, each an integer 1..10, all distinct; the ranking
is the letters sorted by score, highest first.
Where the format is invalid the ranking is still read where it can be (`parse_judgment`).
"""

from __future__ import annotations

import re
from collections import Counter

from pjray.data.prompts import EOS_TOKEN
from pjray.types import Judgment

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SCORE_MIN, SCORE_MAX = 1, 10

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# One letter token, then (whitespace, optional separator, whitespace, token)*. Each gap has a
# single way to match, so a failing match cannot backtrack exponentially.
_TOKEN = r"(?:\[\[[A-Z]\]\]|[A-Z])"
_RANKING_RE = re.compile(rf"{_TOKEN}(?:\s*(?:[>,\u227b]\s*)?{_TOKEN})*")
_LETTER_RE = re.compile(r"[A-Z]")
_INT_RE = re.compile(r"\s*([0-9]{1,4})\s*")  # longer digit strings are rejected, not converted


def _short(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def _layout(text: str, think_prefilled: bool) -> tuple[str | None, list[str], list[str]]:
    """Return (think text, answer block contents, format problems) for a response."""
    problems: list[str] = []
    answers = _ANSWER_RE.findall(text)
    n_open_ans, n_close_ans = text.count("<answer>"), text.count("</answer>")
    if not answers:
        problems.append("no <answer> block" if n_open_ans == 0 else "unclosed <answer> block")
    elif n_open_ans != len(answers) or n_close_ans != len(answers):
        problems.append("unbalanced <answer> tags")

    n_open, n_close = text.count("<think>"), text.count("</think>")
    close = text.find("</think>")
    think: str | None = None
    if think_prefilled:
        # The opening tag was part of the prompt: everything before </think> is the reasoning.
        if n_open:
            problems.append("<think> repeated (the prompt already opened it)")
        if n_close == 0:
            problems.append("no </think>")
        elif n_close > 1:
            problems.append(f"{n_close} </think> tags, expected 1")
        if close >= 0:
            think = text[:close]
    else:
        open_ = text.find("<think>")
        if n_open == 0 and n_close == 0:
            problems.append("no <think> block")
        elif n_open != 1 or n_close != 1:
            problems.append(f"{n_open} <think> and {n_close} </think> tags, expected 1 each")
        if open_ >= 0:
            close = text.find("</think>", open_)
            if close >= 0:
                think = text[open_ + len("<think>") : close]
            elif n_close:
                problems.append("</think> before <think>")
    first_answer = text.find("<answer>")
    if close >= 0 and 0 <= first_answer < close:
        problems.append("<answer> before </think>")
    if answers:
        tail = text[text.rfind("</answer>") + len("</answer>") :].replace(EOS_TOKEN, "").strip()
        if tail:
            problems.append(f"text after the final </answer>: {_short(tail)}")
    return think, answers, problems


def _read_ranking(answer: str, k: int) -> tuple[str | None, str]:
    """Read a letter ranking from one answer block: (letters or None, problem or "")."""
    s = answer.strip()
    if not _RANKING_RE.fullmatch(s):
        return None, f"answer {_short(s)} is not a ranking of letters"
    letters = _LETTER_RE.findall(s)
    allowed = LETTERS[:k]
    extra = sorted({c for c in letters if c not in allowed})
    if extra:
        return None, f"letter(s) {''.join(extra)} not among {allowed}"
    dup = sorted(c for c, n in Counter(letters).items() if n > 1)
    if dup:
        return None, f"duplicated letter(s) {''.join(dup)}"
    ranking = "".join(letters)
    if len(ranking) < k:
        missing = "".join(c for c in allowed if c not in ranking)
        return ranking, f"missing letter(s) {missing}"
    return ranking, ""


def _read_scores(answers: list[str]) -> tuple[tuple[int, ...] | None, str]:
    """Read one integer per answer block: (scores or None, problem or "")."""
    scores = []
    for i, a in enumerate(answers):
        m = _INT_RE.fullmatch(a)
        if m is None:
            return None, f"answer {i + 1} {_short(a.strip())} is not an integer"
        scores.append(int(m.group(1)))
    return tuple(scores), ""


def _last_block(answers: list[str], problems: list[str]) -> str | None:
    """The one answer block a verdict reads (the last, the final one, when there are several,
    which is itself a problem)."""
    if len(answers) > 1:
        problems.append(f"{len(answers)} <answer> blocks, expected 1")
    return answers[-1] if answers else None


def _scores_of(answers: list[str], problems: list[str]) -> tuple[int, ...] | None:
    """One integer a block (None when a block holds none), each in SCORE_MIN..SCORE_MAX; what is
    wrong goes to `problems`, and scores out of range are still returned."""
    scores, problem = _read_scores(answers)
    if scores is None:
        problems.append(problem)
        return None
    problems += _score_problems(scores)
    return scores


def _judgment(
    think: str | None, answers: list[str], ranking: str | None, scores: tuple[int, ...] | None, problems: list[str]
) -> Judgment:
    return Judgment(
        think=think,
        answer="\n".join(answers) if answers else None,
        ranking=ranking,
        scores=scores,
        format_ok=not problems,
        reason="; ".join(problems),
    )


def ranking_from_scores(scores: tuple[int, ...]) -> str:
    """Letters sorted by score, highest first; ties go to the later letter (as in the release)."""
    return "".join(letter for _, letter in sorted(zip(scores, LETTERS), reverse=True))


def _check_args(num_candidates: int, style: str, styles: tuple[str, ...], what: str) -> None:
    if style not in styles:
        raise ValueError(f"{what}: unknown style {style!r}; expected one of {styles}")
    if not 1 <= num_candidates <= len(LETTERS):
        raise ValueError(f"{what}: num_candidates must be in 1..{len(LETTERS)}, got {num_candidates}")


def _score_problems(scores: tuple[int, ...]) -> list[str]:
    bad = [s for s in scores if not SCORE_MIN <= s <= SCORE_MAX]
    return [f"score(s) {bad} outside {SCORE_MIN}..{SCORE_MAX}"] if bad else []


def parse_judgment(text: str, num_candidates: int, style: str = "ranking", think_prefilled: bool = False) -> Judgment:
    """Parse a batch-protocol response over `num_candidates` lettered candidates.

    style: "ranking" (one answer block of letters best -> worst) or "scores" (one integer 1..10
    per candidate in letter order). Raises only on bad arguments, never because of `text`.

    When the format is invalid the ranking is still read where it can be: a missing think block
    or a second answer block (the last one is read) still gives a ranking; a duplicated or
    out-of-range letter, tied scores or a wrong number of scores give `ranking=None`. Missing
    letters give the partial ranking (useful for edit-distance metrics), never format_ok.
    """
    _check_args(num_candidates, style, ("ranking", "scores"), "parse_judgment")
    think, answers, problems = _layout(text, think_prefilled)
    ranking: str | None = None
    scores: tuple[int, ...] | None = None
    if style == "ranking":
        block = _last_block(answers, problems)
        if block is not None:
            ranking, problem = _read_ranking(block, num_candidates)
            if problem:
                problems.append(problem)
    elif answers:
        scores = _scores_of(answers, problems)
        if scores is None:
            pass
        elif len(scores) != num_candidates:
            problems.append(f"{len(scores)} scores, expected {num_candidates}")
        elif len(set(scores)) != len(scores):
            problems.append(f"tied scores {list(scores)}")
        else:
            ranking = ranking_from_scores(scores)
    return _judgment(think, answers, ranking, scores, problems)


def parse_pair(text: str, style: str = "scores", think_prefilled: bool = False) -> Judgment:
    """Parse a pair-protocol response; `ranking` holds the verdict "A", "B" or "C" (tie).

    style "scores": exactly two integer answer blocks 1..10; equal scores are a tie ("C") and
    valid. style "ranking": one answer block holding A, B or C (also `[[A]]`).
    """
    _check_args(2, style, ("ranking", "scores"), "parse_pair")
    think, answers, problems = _layout(text, think_prefilled)
    verdict: str | None = None
    scores: tuple[int, ...] | None = None
    if style == "ranking":
        block = _last_block(answers, problems)
        if block is not None:
            s = block.strip()
            if s.startswith("[[") and s.endswith("]]"):
                s = s[2:-2].strip()
            if s in ("A", "B", "C"):
                verdict = s
            else:
                problems.append(f"answer {_short(s)} is not A, B or C")
    elif answers:
        scores = _scores_of(answers, problems)
        if scores is None:
            pass
        elif len(scores) != 2:
            problems.append(f"{len(scores)} scores, expected 2")
        else:
            verdict = "A" if scores[0] > scores[1] else "B" if scores[0] < scores[1] else "C"
    return _judgment(think, answers, verdict, scores, problems)


def parse_score(text: str, think_prefilled: bool = False) -> Judgment:
    """Parse a score-protocol response: one integer answer block 1..10, in `scores[0]`.

    `ranking` is always None. A score outside 1..10 is kept in `scores` but not format_ok.
    """
    think, answers, problems = _layout(text, think_prefilled)
    # Read the last block, the final verdict, when there are several.
    block = _last_block(answers, problems)
    scores = None if block is None else _scores_of([block], problems)
    return _judgment(think, answers, None, scores, problems)
