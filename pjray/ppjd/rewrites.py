"""Perception and reasoning errors of free-text answers, and their ranked levels: the rules
backend of the PPJD "rewrite rejecteds" step for rows without scene facts, built on the lexicon
(`pjray.ppjd.lexicon`). The same for the same random stream.

- A *perception error* (`perception_options`) rewrites one lexeme of the chosen answer at every
  mention; the first one is decisive: it makes the final answer wrong (`decisive_options`).
- A *reasoning error* (`reasoning_perturb`) then breaks one step; the final answer stays wrong.

Ranked levels best -> worst (`ranked_rewrites`), as for scenes (`pjray.ppjd.perturb`): the
*nested* construction (0 chosen | 1 P | 2 P+R | 3 PP+R ...) shares level 1's wrong fact with
every later level, so the text alone ranks it (`pjray.ppjd.shortcuts`); the *independent* one
(`independent_rewrites`) gives each wrong level its own decisive error with a value no other
level states. Reasoning errors are surface edits. A row with no decisive edit, or one a
construction cannot carry, is rejected with the reason (`RowDataError`).
"""

from __future__ import annotations

import math
import operator
import random
import string
from collections.abc import Iterable

from pjray.ppjd.lexicon import (
    ANTONYMS,
    COLOURS,
    COMPARATIVE_RE,
    COPULA_RE,
    COUNTS,
    EQUATION_RE,
    FLIPS,
    NUMBER_RE,
    SHAPES,
    Change,
    Mention,
    Rewrite,
    Slip,
    Source,
    cased,
    change_edits,
    choices,
    context_of,
    final_span,
    find_mentions,
    fold,
    key_of,
    lexemes,
    move_choice,
    number_value,
    readable,
    render_value,
    sentence_spans,
    splice,
    step_spans,
)
from pjray.ppjd.perturb import CONSTRUCTIONS, final_answer, normalize_answer
from pjray.ppjd.rejects import RowDataError

__all__ = [
    "REASONING_KINDS",
    "decisive_options",
    "independent_rewrites",
    "nested_rewrites",
    "perception_options",
    "perceptual_perturb",
    "ranked_rewrites",
    "reasoning_perturb",
    "reasoning_sites",
    "stated_lexemes",
]


# --------------------------------------------------------------------------- perception errors


def _replacements(
    src: Source, m: Mention, known: set[tuple[str, str]], touched: set[tuple[str, str]], rng: random.Random
) -> list[str]:
    """Values `m`'s lexeme may become (for text: the new string, cased)."""
    taken = {k for c, k in known if c == m.cls}
    if m.cls in ANTONYMS:
        value = ANTONYMS[m.cls][m.key]
        return [] if (m.cls, value) in touched else [value]
    if m.cls == "colour":
        return [c for c in COLOURS if c not in taken]
    if m.cls == "shape":
        return [s for s in next(g for g in SHAPES if m.key in g) if s not in taken]
    if m.cls == "count":
        near = sorted(COUNTS, key=lambda n: (abs(n - int(m.key)), n))
        return [str(n) for n in near if abs(n - int(m.key)) <= 3 and str(n) not in taken]
    others = [t for t in choices(src.question).values() if fold(t) not in taken and readable(t)]
    misread = _misread(m.surface, rng)
    return ([misread] if fold(misread) not in taken else []) + others


def _misread(s: str, rng: random.Random) -> str:
    """`s` with one letter or digit replaced by another of the same kind and case."""
    i = rng.choice([i for i, ch in enumerate(s) if ch.isascii() and ch.isalnum()])
    pool = string.digits if s[i].isdigit() else string.ascii_uppercase if s[i].isupper() else string.ascii_lowercase
    return s[:i] + rng.choice([ch for ch in pool if ch != s[i]]) + s[i + 1 :]


def _wrong(text: str, truth: str) -> bool:
    final = final_answer(text)
    return final is not None and normalize_answer(final) != normalize_answer(truth)


def perception_options(src: Source, r: Rewrite, rng: random.Random) -> list[Rewrite]:
    """`r` with one more perception error, one per untouched lexeme of the chosen answer and value
    that leaves the final wrong. From the chosen answer (final = truth) these are the decisive errors.

    An error rewrites the lexeme at every mention, on word boundaries, keeping case, digit/word
    and singular/plural form, and fixing "a"/"an": a colour, count or shape becomes another value
    of its class that the answer does not mention (counts move by at most three, shapes stay flat
    or solid), a relation or size its antonym (swapped with it where both are mentioned, so the
    answer stays self-consistent), quoted text a one-character misreading or another option's text.
    """
    mentions, in_chosen = find_mentions(r.text), lexemes(find_mentions(src.chosen))
    touched = r.touched()
    numbers = {("count", str(number_value(m.group()))) for t in (r.text, src.chosen) for m in NUMBER_RE.finditer(t)}
    known = {(m.cls, m.key) for m in mentions} | set(in_chosen) | touched | numbers
    options = []
    for (cls, key), m in lexemes(mentions).items():
        if (cls, key) in touched or (cls, key) not in in_chosen:
            continue
        context = context_of(src.chosen, in_chosen[cls, key])
        for value in _replacements(src, m, known, touched, rng):
            text = splice(r.text, change_edits(mentions, cls, key, value))
            text = move_choice(src.question, text, cls, key, fold(value) if cls == "text" else value)
            if _wrong(text, src.truth):
                change = Change(cls, m.surface, render_value(cls, value, m.surface), context)
                options.append(Rewrite(text, r.changes + (change,), r.slips))
    return options


def _pick(options: list[Rewrite], rng: random.Random) -> Rewrite:
    """A lexeme first, then its value, so classes with many values do not crowd out the others."""
    lexemes = list(dict.fromkeys((o.changes[-1].cls, o.changes[-1].original) for o in options))
    lexeme = lexemes[rng.randrange(len(lexemes))]
    return rng.choice([o for o in options if (o.changes[-1].cls, o.changes[-1].original) == lexeme])


def decisive_options(src: Source, rng: random.Random) -> list[Rewrite]:
    """The chosen answer with one decisive perception error, one per lexeme and value; raises
    RowDataError when there is none.

    Decisive: the final answer contains the word, or the final is a multiple-choice letter whose
    option names it and another option reads like the edited one, and the letter moves there. A
    final that names no lexicon word (yes/no, a computed number, a letter whose option does not
    map to another one) has none; a final holding both a letter and its option text has only the
    text edited; a letter the body names other than as "option/choice/answer X" is not moved."""
    if not find_mentions(src.chosen):
        raise RowDataError(
            "no perception attribute words (colour, count, relation, size, shape or quoted text) in the answer"
        )
    options = perception_options(src, Rewrite(src.chosen), rng)
    if not options:
        raise RowDataError(
            f"no decisive perception error: no attribute word the answer mentions changes its "
            f"final answer {final_answer(src.chosen)!r}"
        )
    return options


def perceptual_perturb(src: Source, rng: random.Random) -> Rewrite:
    """The perception-only counterfactual: one decisive perception error, reasoning intact."""
    return _pick(decisive_options(src, rng), rng)


# --------------------------------------------------------------------------- reasoning errors


def _format_like(x: float, like: str) -> str:
    decimals = len(like.split(".")[1]) if "." in like else 0
    return f"{x:.{decimals}f}"


_OPERATIONS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "x": operator.mul,
    "×": operator.mul,
    "/": operator.truediv,
    "÷": operator.truediv,
}


def _arithmetic_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    """Correct `a op b = c` steps, each with wrong values for c."""
    sites = []
    for m in EQUATION_RE.finditer(r.text):
        a, op, b, c = float(m.group(1)), m.group(2), float(m.group(3)), float(m.group(4))
        if op in "/÷" and b == 0:
            continue
        if abs(_OPERATIONS[op](a, b) - c) <= 1e-6 * max(1.0, abs(c)):
            wrong = [_format_like(c + d, m.group(4)) for d in (1, -1, 2, 10) if c + d >= 0]
            sites.append((m.start(4), m.end(4), wrong))
    return sites


def _comparative_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    mentions = find_mentions(r.text)
    return [
        (m.start(), m.end(), [cased(m.group(), FLIPS[m.group().lower()])])
        for m in COMPARATIVE_RE.finditer(r.text)
        if not any(m.start() < x.end and x.start < m.end() for x in mentions)
    ]


def _negation_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    """The last copula of the conclusion (the step before the final answer): add or drop "not"."""
    steps = step_spans(r.text)
    if not steps:
        return []
    a, b = steps[-1]
    copulas = list(COPULA_RE.finditer(r.text, a, b))
    if not copulas:
        return []
    m = copulas[-1]
    if m.group(2):
        return [(m.end(1), m.end(2), [""])]
    return [(m.end(1), m.end(1), [" not"])]


def _skip_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    """Plain middle steps of an answer with three or more: no perturbed fact (it must stay visible),
    no equation or comparative (an earlier reasoning error must stay too)."""
    steps = step_spans(r.text)
    perturbed = {(c.cls, key_of(c.cls, c.perturbed)) for c in r.changes}
    sites = []
    for a, b in steps[1:-1] if len(steps) >= 3 else []:
        step = r.text[a:b]
        if any((m.cls, m.key) in perturbed for m in find_mentions(step)) or any(
            p.search(step) for p in (EQUATION_RE, COMPARATIVE_RE)
        ):
            continue
        end = b
        while end < len(r.text) and r.text[end] in " \t":
            end += 1
        if (a == 0 or r.text[a - 1] == "\n") and end < len(r.text) and r.text[end] == "\n":
            end += 1  # the step was a whole line: drop the line
        sites.append((a, end, [""]))
    return sites


REASONING_KINDS = (
    ("arithmetic", _arithmetic_sites),
    ("comparative", _comparative_sites),
    ("negation", _negation_sites),
    ("skipped_step", _skip_sites),
)


def reasoning_sites(r: Rewrite) -> tuple[str, list[tuple[int, int, list[str]]]] | None:
    """The most preferred kind of reasoning error `r` still admits, with its sites; None if none.

    Kinds, most preferred first: a wrong arithmetic result (`a op b = c`), a flipped comparative
    (more/less ... than, most/least, increase/decrease; none of them lexicon words), a negated
    conclusion (the copula of the sentence before the final answer), a skipped step (a plain
    middle sentence of at least three). Each kind is used once per answer, except arithmetic (a
    broken step is no longer a site).
    """
    used = {s.kind for s in r.slips}
    span = final_span(r.text)
    body_end = span[0] if span else len(r.text)
    for kind, sites_of in REASONING_KINDS:
        if kind in used and kind != "arithmetic":
            continue
        sites = [s for s in sites_of(r) if s[1] <= body_end]
        if sites:
            return kind, sites
    return None


def reasoning_perturb(r: Rewrite, rng: random.Random) -> Rewrite:
    """`r` with one reasoning error added; its perception errors and its final answer stay.
    A surface edit: a skipped step may leave a later step referring to it, and only
    "is/are/was/were" conclusions can be negated."""
    found = reasoning_sites(r)
    if found is None:
        raise RowDataError(
            "no reasoning error possible: no arithmetic step, comparative, 'is/are' conclusion "
            "or three steps to skip one of"
        )
    kind, sites = found
    start, end, values = sites[rng.randrange(len(sites))]
    text = r.text[:start] + rng.choice(values) + r.text[end:]
    a, b = next((a, b) for a, b in sentence_spans(r.text) if a <= start < b or a < end <= b)
    after = "" if kind == "skipped_step" else text[a : b + len(text) - len(r.text)]
    return Rewrite(text, r.changes, r.slips + (Slip(kind, r.text[a:b], after),))


# --------------------------------------------------------------------------- ranked levels


def ranked_rewrites(
    question: str, chosen: str, num_candidates: int, rng: random.Random, construction: str = "nested"
) -> list[Rewrite]:
    """Levels 0..K-1 (best -> worst) of `construction` (`CONSTRUCTIONS`): `nested_rewrites` or
    `independent_rewrites`."""
    if num_candidates < 2:
        raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"unknown PPJD construction {construction!r}; expected one of {CONSTRUCTIONS}")
    truth = final_answer(chosen)
    if truth is None:
        raise RowDataError("the chosen answer has no final answer (\\boxed{} or 'Final Answer:')")
    src = Source(question, chosen, truth)
    if construction == "independent":
        return independent_rewrites(src, num_candidates, rng)
    return nested_rewrites(src, num_candidates, rng)


def nested_rewrites(src: Source, num_candidates: int, rng: random.Random) -> list[Rewrite]:
    """Levels 0..K-1 (best -> worst): chosen | P | P+R | PP+R | ...; each adds one error to the one
    before, a reasoning error where no lexeme is left to change."""
    levels = [Rewrite(src.chosen), perceptual_perturb(src, rng)]
    while len(levels) < num_candidates:
        last = levels[-1]
        options = perception_options(src, last, rng) if len(levels) > 2 else []  # level 2 is P+R
        if options:
            levels.append(_pick(options, rng))
        elif reasoning_sites(last) is not None:
            levels.append(reasoning_perturb(last, rng))
        else:
            raise RowDataError(
                f"num_candidates={num_candidates}: this answer supports at most {len(levels)} "
                f"ranked levels (no perception or reasoning error left to add)"
            )
    return levels


_TRIES = 64  # draws per level before the independent construction gives up on an answer


def stated_lexemes(text: str) -> frozenset[tuple[str, str]]:
    """The (class, value) attribute words a text states: what the text-only ranker compares
    (`pjray.ppjd.shortcuts.stated_fact`)."""
    return frozenset(lexemes(find_mentions(text)))


def _wrong_facts(changes: Iterable[Change]) -> set[tuple[str, str]]:
    """(class, value) of the wrong fact each change states."""
    return {(c.cls, key_of(c.cls, c.perturbed)) for c in changes}


def _decided(r: Rewrite) -> tuple[str, str]:
    """The lexeme whose change made `r`'s final wrong: its first change."""
    c = r.changes[0]
    return c.cls, key_of(c.cls, c.original)


def _wrong_finals(src: Source, options: list[Rewrite]) -> dict[tuple[str, str], float]:
    """How many different wrong final answers each decisive lexeme offers; a misreading of quoted
    text offers any number (each draw misreads it anew)."""
    option_texts = {fold(t) for t in choices(src.question).values()}
    finals: dict[tuple[str, str], set[str]] = {}
    unbounded = set()
    for o in options:
        finals.setdefault(_decided(o), set()).add(normalize_answer(o.final))
        if o.changes[0].cls == "text" and fold(o.changes[0].perturbed) not in option_texts:
            unbounded.add(_decided(o))
    return {x: math.inf if x in unbounded else len(f) for x, f in finals.items()}


def independent_rewrites(src: Source, num_candidates: int, rng: random.Random) -> list[Rewrite]:
    """Levels 0..K-1 (best -> worst) in which every wrong level has its own decisive perception
    error, no two levels state the same wrong fact, final answer or set of attribute words, and
    level l has l errors. Raises RowDataError (a ValueError) when the answer cannot carry it.

    K = 3: "blue" correct, "red" with its reasoning intact, "green" with a reasoning error, on the
    same lexeme where it has the values. Level l >= 2 adds l - 1 errors: reasoning errors (at
    least one, level 2 is P+R), then perception errors stating no other level's wrong fact. An
    answer whose decisive words offer fewer than K - 1 wrong finals (a final "left" or "large", a
    letter with one other matching option), or that admits no reasoning error, cannot carry it."""
    levels = [Rewrite(src.chosen)]
    for level in range(1, num_candidates):
        for _ in range(_TRIES):
            r = _independent_level(src, level, levels, num_candidates, rng)
            if r is not None:
                break
        else:
            raise RowDataError(_why_not_independent(src, level, num_candidates, rng))
        levels.append(r)
    return levels


def _independent_level(
    src: Source, level: int, earlier: list[Rewrite], num_candidates: int, rng: random.Random
) -> Rewrite | None:
    """One draw of a level with `level` errors that states no wrong fact, final answer or set of
    attribute words of an `earlier` level; None where this draw ran out of options."""
    taken = _wrong_facts(c for r in earlier for c in r.changes)
    finals = {normalize_answer(r.final) for r in earlier}
    fresh = [
        o
        for o in decisive_options(src, rng)
        if not _wrong_facts(o.changes) & taken and normalize_answer(o.final) not in finals
    ]
    # The lexeme the earlier levels changed, else one that has a wrong value for every level left:
    # when all wrong levels misstate the same fact, no vote over the facts each candidate states
    # finds the chosen answer as the one that agrees with the others on every fact.
    used = {_decided(r) for r in earlier[1:]}
    wide = {x for x, n in _wrong_finals(src, fresh).items() if n >= num_candidates - level}
    pool = [o for o in fresh if _decided(o) in used] or [o for o in fresh if _decided(o) in wide] or fresh
    if not pool:
        return None
    r = _pick(pool, rng)
    while len(r.changes) + len(r.slips) < level:
        if reasoning_sites(r) is not None:
            r = reasoning_perturb(r, rng)
            continue
        if not r.slips:
            return None  # a level past 1 is perception + reasoning, as in the nested tuple
        more = [o for o in perception_options(src, r, rng) if not _wrong_facts(o.changes[-1:]) & taken]
        if not more:
            return None
        r = _pick(more, rng)
    # A later error can move the final (a second word of it) or drop a mention (a skipped step).
    if normalize_answer(r.final) in finals or stated_lexemes(r.text) in {stated_lexemes(e.text) for e in earlier}:
        return None
    return r


def _why_not_independent(src: Source, level: int, num_candidates: int, rng: random.Random) -> str:
    """The reject reason when no draw of `level` worked: too few wrong finals, no reasoning error for
    a level past 1, else too few errors without repeating another level's."""
    options = decisive_options(src, rng)
    wrong: dict[str, Change] = {}
    for o in options:
        wrong.setdefault(normalize_answer(o.final), o.changes[0])
    if len(wrong) < num_candidates - 1 and math.isfinite(sum(_wrong_finals(src, options).values())):
        found = ", ".join(f"{c.cls} {c.original!r} -> {c.perturbed!r}" for c in wrong.values())
        return (
            f"independent construction: {num_candidates - 1} wrong candidates need as many different wrong "
            f"final answers, and the attribute words that decide the final {src.truth!r} give {len(wrong)} "
            f"({found})"
        )
    if level >= 2 and all(reasoning_sites(o) is None for o in options):
        return (
            f"independent construction: level {level} is perception + reasoning, and no reasoning error fits "
            f"this answer (no arithmetic step, comparative, 'is/are' conclusion or three steps to skip one of)"
        )
    return (
        f"independent construction: no draw of level {level} has its {level} errors (a decisive perception "
        f"error, then reasoning errors, then perception errors) without a wrong fact, final answer or set of "
        f"attribute words another level states"
    )
