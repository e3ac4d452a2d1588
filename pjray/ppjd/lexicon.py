"""Lexicon-driven perception and reasoning perturbations of free-text answers.

This is the rules backend of the PPJD "rewrite rejecteds" step for rows without scene facts
(MMPR, generic JSONL / parquet): a question, a chosen answer that ends in a final answer
(`\\boxed{...}` or a "Final Answer:" line), and the ground truth. No model is involved: every
edit is a word-level rewrite found with a small lexicon, recorded exactly (`Rewrite`), and the
same for the same random stream.

- A *mention* (`find_mentions`) is a word of one perception class: colour, count, spatial
  relation, size, shape, or text read from the image (a quoted string).
- A *perception error* (`perception_options`) rewrites one lexeme of the chosen answer at every
  mention; the first one is decisive: it makes the final answer wrong (`decisive_options`).
- A *reasoning error* (`reasoning_perturb`) then breaks one step; the final answer stays wrong.

Ranked levels best -> worst (`ranked_rewrites`), as for scenes (`pjray.ppjd.perturb`): the
*nested* construction (0 chosen | 1 P | 2 P+R | 3 PP+R ...) shares level 1's wrong fact with
every later level, so the text alone ranks it (`pjray.ppjd.shortcuts`); the *independent* one
(`independent_rewrites`) gives each wrong level its own decisive error with a value no other
level states.

Limits: these are word lists, not understanding. A lexicon word in another sense is edited as an
attribute unless it is a listed collocation, a fact stated without a lexicon word is invisible,
and reasoning errors are surface edits. A row with no decisive edit, or one a construction
cannot carry, is rejected with the reason (`RowDataError`).
"""

from __future__ import annotations

import math
import operator
import random
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pjray.ppjd.perturb import CONSTRUCTIONS, final_answer, normalize_answer
from pjray.ppjd.rejects import RowDataError

CLASSES: tuple[str, ...] = ("colour", "count", "relation", "size", "shape", "text")

COLOURS: tuple[str, ...] = (
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
    "gray",
    "cyan",
)
SPELLINGS: dict[str, str] = {"grey": "gray"}
NUMBER_WORDS: tuple[str, ...] = tuple(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split()
)
COUNTS = range(2, 21)
RELATION_PAIRS: tuple[tuple[str, str], ...] = (
    ("left", "right"),
    ("leftmost", "rightmost"),
    ("above", "below"),
    ("top", "bottom"),
    ("topmost", "bottommost"),
    ("upper", "lower"),
    ("in front of", "behind"),
    ("inside", "outside"),
)
SIZE_ANTONYMS: dict[str, str] = {
    "small": "large",
    "large": "small",
    "big": "small",
    "tall": "short",
    "short": "tall",
    "wide": "narrow",
    "narrow": "wide",
    "thick": "thin",
    "thin": "thick",
    "huge": "tiny",
    "tiny": "huge",
}
# A replacement shape stays in its group: flat shapes, then solids.
SHAPES: tuple[tuple[str, ...], ...] = (
    ("circle", "square", "triangle", "rectangle", "star", "oval", "hexagon", "pentagon", "diamond"),
    ("cube", "sphere", "cylinder", "cone"),
)
ANTONYMS: dict[str, dict[str, str]] = {
    "relation": {a: b for pair in RELATION_PAIRS for a, b in (pair, pair[::-1])},
    "size": SIZE_ANTONYMS,
}

# Comparatives a reasoning error flips; the first six only before "than". None is a lexicon word
# ("lower than" is excluded from the relations below).
FLIPS: dict[str, str] = {
    "more": "less",
    "less": "more",
    "fewer": "more",
    "greater": "less",
    "higher": "lower",
    "lower": "higher",
    "most": "least",
    "least": "most",
    "highest": "lowest",
    "lowest": "highest",
    "maximum": "minimum",
    "minimum": "maximum",
    "increase": "decrease",
    "increases": "decreases",
    "increased": "decreased",
    "increasing": "decreasing",
    "decrease": "increase",
    "decreases": "increases",
    "decreased": "increased",
    "decreasing": "increasing",
}


def _word_table() -> dict[str, tuple[str, str]]:
    """Lowercase surface form -> (class, value) for every lexicon word except numbers."""
    table = {c: ("colour", c) for c in COLOURS} | {s: ("colour", c) for s, c in SPELLINGS.items()}
    for cls, antonyms in ANTONYMS.items():
        table |= {w: (cls, w) for w in antonyms}
    for group in SHAPES:
        table |= {form: ("shape", s) for s in group for form in (s, s + "s")}
    return table


WORDS: dict[str, tuple[str, str]] = _word_table()


def _alternation(words: list[str]) -> str:
    return "|".join(re.escape(w).replace(r"\ ", r"\s+") for w in sorted(words, key=len, reverse=True))


_WORD_RE = re.compile(rf"(?<!\w)(?:{_alternation(list(WORDS))})(?!\w)", re.IGNORECASE)
_NUMBER = rf"\d+|{_alternation(list(NUMBER_WORDS[2:]))}"
_NUMBER_RE = re.compile(rf"(?<![\w.,:/^-])(?:{_NUMBER})(?![\w:/^-]|[.,]\d)", re.IGNORECASE)
# Numbers on either side of an operator take part in arithmetic; their values are never counts.
_OPERAND_RE = re.compile(rf"(?<![\w.])(?:\d+(?:\.\d+)?|{_alternation(list(NUMBER_WORDS))})(?![\w]|\.\d)", re.IGNORECASE)
_OPERATOR_RE = re.compile(r"[-+*/×÷=^<>]|x|plus|minus|times|equals|over|divided by|multiplied by", re.IGNORECASE)
_RESULT_RE = re.compile(r"=\s*$")
# A number after one of these labels something ("step 3"); it is not a count.
_LABEL_RE = re.compile(
    r"\b(?:step|option|choice|figure|fig\.?|page|line|equation|question|part|case|row|column|rule|item|"
    r"chapter|section|number|no\.|level|grade|year|day)\s*$",
    re.IGNORECASE,
)
_NEXT_WORD = re.compile(r"\**[ \t]+\**([A-Za-z]+)")
# Words after a number that show it is not counting things (function words, operators, units).
_NOT_NOUNS = frozenset(
    "a an the and or of is are was were be to in on at by with for from than times plus minus more less fewer "
    "out over into equals so but as if then percent degree degrees cm mm m km kg g mg ml l s sec seconds "
    "minutes hours years unit units inch inches foot feet meter meters metre metres mile miles".split()
)
# Collocations where a lexicon word is not an attribute; group "w" marks the word.
_NOT_ATTRIBUTES: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\b(?P<w>right)[\s-]+(?:angle|angled|angles|triangle|triangles|answer|answers|option|options|choice|"
        r"choices|now|away)\b",
        r"\b(?:all|that's|is|are|was|were)\s+(?P<w>right)\b(?!\s+(?:of|side|corner|half|edge|hand|part|column))",
        r"\b(?:is|are|was|were|be|remain|remains|remaining|only)\s+(?P<w>left)\b"
        r"(?!\s+(?:of|side|corner|half|edge|hand|part|column))",
        r"\b(?P<w>left)\s+(?:over|with)\b",
        r"\b(?:as|the|see|shown|mentioned|stated|given|listed|computed|calculated|found|described)\s+"
        r"(?P<w>above|below)\b",
        r"\b(?P<w>above|below)\s+(?:\d|average|zero)",
        r"\b(?P<w>upper|lower)\s+(?:bound|bounds|limit|limits|case)\b",
        r"\b(?P<w>lower)\s+than\b",
        r"\b(?P<w>square|cube)\s+(?:roots?|units?|numbers?|meters?|metres?|centimeters?|centimetres?|feet|inches|"
        r"miles|kilometers?|cm|mm|m|km)\b",
        r"\b(?:in|for)\s+(?P<w>short)\b",
        r"\b(?P<w>short)\s+of\b",
    )
)
_QUOTED_RE = re.compile(r'"([^"\n]{1,40})"|“([^”\n]{1,40})”|(?<!\w)\'([^\'\n]{1,40})\'(?!\w)')
_OPTION_RE = re.compile(r"^\s*\(?([A-H])\s*[).:]\s*(.+?)\s*$", re.MULTILINE)
_LETTER_RE = re.compile(r"\(?([A-Ha-h])\)?")  # a final answer that is an option letter
_ARTICLE_RE = re.compile(r"(?<!\w)(an?)\s+$", re.IGNORECASE)
_EQUATION_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([-+*/×÷x])\s*(\d+(?:\.\d+)?)\s*=\s*(\d+(?:\.\d+)?)(?!\d|\.\d)")
_COMPARATIVE_RE = re.compile(
    r"\b(?:(?:more|less|fewer|greater|higher|lower)(?=(?:\s+[\w-]+){0,2}\s+than\b)|"
    r"(?:most|least|highest|lowest|maximum|minimum|(?:in|de)creas(?:e|es|ed|ing)))\b",
    re.IGNORECASE,
)
_COPULA_RE = re.compile(r"\b(is|are|was|were)\b(\s+not\b)?", re.IGNORECASE)

Edit = tuple[int, int, str]  # replace text[start:end] with the string


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Mention:
    """One attribute word in a text; `key` is its canonical value ("gray", "3", "circle", "stop")."""

    cls: str
    key: str
    start: int
    end: int
    surface: str


@dataclass(frozen=True)
class Change:
    """One perception fact an answer states differently: `original` -> `perturbed` at every mention."""

    cls: str
    original: str
    perturbed: str
    context: str  # a few words around the first mention in the chosen answer, the mention blanked

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cls, "original": self.original, "perturbed": self.perturbed, "context": self.context}


@dataclass(frozen=True)
class Slip:
    """One reasoning error: the sentence it broke, before and after ("" for a skipped step)."""

    kind: str  # arithmetic | comparative | negation | skipped_step
    original: str
    perturbed: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "original": self.original, "perturbed": self.perturbed}


@dataclass(frozen=True)
class Source:
    """What every edit is checked against: the question (its options), the chosen answer, the truth."""

    question: str
    chosen: str
    truth: str


@dataclass(frozen=True)
class Rewrite:
    """An answer text with the perception and reasoning errors that made it."""

    text: str
    changes: tuple[Change, ...] = ()
    slips: tuple[Slip, ...] = ()

    @property
    def final(self) -> str | None:
        return final_answer(self.text)

    def touched(self) -> set[tuple[str, str]]:
        """(class, value) of every lexeme an earlier change used, on either side."""
        return {(c.cls, _key(c.cls, s)) for c in self.changes for s in (c.original, c.perturbed)}

    def to_json(self) -> dict[str, Any]:
        return {
            "perception_errors": len(self.changes),
            "reasoning_errors": len(self.slips),
            "changes": [c.to_json() for c in self.changes],
            "breaks": [s.to_json() for s in self.slips],
            "probes": [{"question": probe_question(c), "answer": c.original, "class": c.cls} for c in self.changes],
            "final": self.final,
        }


# --------------------------------------------------------------------------- mentions


def _fold(s: str) -> str:
    return " ".join(s.lower().split())


def _number_value(s: str) -> int:
    return int(s) if s.isdigit() else NUMBER_WORDS.index(s.lower())


def _key(cls: str, surface: str) -> str:
    """The canonical value of a surface form of class `cls`."""
    if cls == "count":
        return str(_number_value(surface))
    if cls == "text":
        return _fold(surface)
    return WORDS[_fold(surface)][1]


def _readable(s: str) -> bool:
    """Short text that could be read off an image: 1-4 words with two ASCII letters or digits."""
    return len(s.split()) <= 4 and sum(ch.isascii() and ch.isalnum() for ch in s) >= 2


def _occurrences(text: str, key: str) -> list[re.Match[str]]:
    """Whole-word, case-insensitive occurrences of the string `key` (any run of spaces for a space)."""
    pattern = re.escape(key).replace(r"\ ", r"\s+")
    return list(re.finditer(rf"(?<!\w){pattern}(?!\w)", text, re.IGNORECASE))


def _text_mentions(text: str) -> list[Mention]:
    """Quoted strings and every other occurrence of them (case-insensitive, whole words)."""
    keys: dict[str, None] = {}
    for m in _QUOTED_RE.finditer(text):
        s = next(g for g in m.groups() if g is not None).strip()
        if _readable(s):
            keys.setdefault(_fold(s))
    found: list[Mention] = []
    for key in sorted(keys, key=len, reverse=True):  # a longer string claims its words first
        for m in _occurrences(text, key):
            if not any(m.start() < o.end and o.start < m.end() for o in found):
                found.append(Mention("text", key, m.start(), m.end(), m.group()))
    return found


def _arithmetic_values(text: str) -> set[float]:
    """Values of the numbers joined to a neighbouring number by an operator, or following "="."""
    operands = list(_OPERAND_RE.finditer(text))
    joined = {
        i
        for i, (x, y) in enumerate(zip(operands, operands[1:]))
        if _OPERATOR_RE.fullmatch(" ".join(text[x.end() : y.start()].split()))
    }
    return {
        float(_number_value(m.group()) if m.group()[0].isalpha() else m.group())
        for i, m in enumerate(operands)
        if i in joined or i - 1 in joined or _RESULT_RE.search(text, 0, m.start())
    }


def _count_mentions(text: str) -> list[Mention]:
    """Number tokens 2..20 of values that count something somewhere and never take part in arithmetic."""
    arithmetic = _arithmetic_values(text)
    tokens = [
        (m, _number_value(m.group()))
        for m in _NUMBER_RE.finditer(text)
        if not _LABEL_RE.search(text, max(0, m.start() - 24), m.start())
    ]
    tokens = [(m, v) for m, v in tokens if v in COUNTS and float(v) not in arithmetic]
    counted = {v for m, v in tokens if _counts_something(text, m.end())}
    return [Mention("count", str(v), m.start(), m.end(), m.group()) for m, v in tokens if v in counted]


def _counts_something(text: str, end: int) -> bool:
    nxt = _NEXT_WORD.match(text, end)
    return nxt is not None and nxt.group(1).lower() not in _NOT_NOUNS


def find_mentions(text: str) -> list[Mention]:
    """Every attribute mention in `text`, by position; no two overlap (the classes are disjoint).

    A mention is a word of one perception class, and belongs to one (class, value) lexeme: colour,
    count (a number word or an integer 2..20, where the value is followed by a noun somewhere),
    spatial relation, size, shape, or text read from the image (a quoted string, with every other
    occurrence of it). A lexicon word in another sense is a mention unless it is one of the listed
    collocations ("right angle", "square root", "is left", "lower than", "as shown above", ...); a
    fact stated without a lexicon word ("crimson", "a pair", "twice as many") is invisible; a
    quoted string is taken for text in the image, and masks lexicon words inside it. Counts used
    in arithmetic are not mentions (the arithmetic would no longer hold), and the number 1 never
    is (editing it would break agreement with the noun)."""
    found = _text_mentions(text)
    quoted = [(m.start, m.end) for m in found]
    excluded = {m.span("w") for pattern in _NOT_ATTRIBUTES for m in pattern.finditer(text)}
    words = [Mention(*WORDS[_fold(m.group())], m.start(), m.end(), m.group()) for m in _WORD_RE.finditer(text)]
    for m in [*words, *_count_mentions(text)]:
        if (m.start, m.end) not in excluded and not any(m.start < b and a < m.end for a, b in quoted):
            found.append(m)
    return sorted(found, key=lambda m: m.start)


def lexemes(mentions: list[Mention]) -> dict[tuple[str, str], Mention]:
    """(class, value) -> its first mention, in order of first mention."""
    first: dict[tuple[str, str], Mention] = {}
    for m in mentions:
        first.setdefault((m.cls, m.key), m)
    return first


def mentioned_attributes(text: str) -> list[str]:
    """ "class: word" for each lexeme `text` mentions, in order of first mention."""
    return [f"{m.cls}: {m.surface}" for m in lexemes(find_mentions(text)).values()]


def _value_mentions(text: str, cls: str, keys: set[str]) -> list[Mention]:
    """Occurrences of the values `keys` of class `cls` in any text (an option), without context rules."""
    if cls == "text":
        return [Mention(cls, k, m.start(), m.end(), m.group()) for k in sorted(keys) for m in _occurrences(text, k)]
    if cls == "count":
        found = [
            Mention(cls, str(_number_value(m.group())), m.start(), m.end(), m.group())
            for m in _NUMBER_RE.finditer(text)
        ]
    else:
        found = [Mention(*WORDS[_fold(m.group())], m.start(), m.end(), m.group()) for m in _WORD_RE.finditer(text)]
    return [m for m in found if m.cls == cls and m.key in keys]


# --------------------------------------------------------------------------- text surgery


def _cased(model: str, word: str) -> str:
    """`word` in the case of `model`: "RED" -> "BLUE", "Red" -> "Blue", "red" -> "blue"."""
    if len(model) > 1 and model.isupper():
        return word.upper()
    if model.islower():
        return word.lower()
    if model[:1].isupper():
        return word[:1].upper() + word[1:]
    return word


def _render(cls: str, value: str, surface: str) -> str:
    """`value` written in the form of the mention `surface`: digits or words, singular or plural, case."""
    if cls == "count":
        word = value if surface.isdigit() else NUMBER_WORDS[int(value)]
    elif cls == "shape" and _fold(surface).endswith("s"):
        word = value + "s"
    else:
        word = value
    return _cased(surface, word)


def _splice(text: str, edits: list[Edit]) -> str:
    """Apply non-overlapping edits; an "a"/"an" right before an edit is fixed to fit the new word."""
    articles = []
    for start, _, new in edits:
        article = _ARTICLE_RE.search(text, max(0, start - 4), start)
        if article and new[:1].isalpha():
            want = "an" if new[0].lower() in "aeiou" else "a"
            articles.append((article.start(1), article.end(1), _cased(article.group(1), want)))
    out = text
    for start, end, new in sorted([*edits, *articles], reverse=True):
        out = out[:start] + new + out[end:]
    return out


def _final_span(text: str) -> tuple[int, int] | None:
    """Where the final answer stands: its last occurrence, since the final ends the answer."""
    final = final_answer(text)
    if final is None:
        return None
    start = text.rfind(final)
    return start, start + len(final)


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence: lines, cut after ., ! or ? followed by a space."""
    spans = []
    for line in re.finditer(r"[^\n]+", text):
        start = line.start()
        for cut in re.finditer(r"(?<=[.!?])\s+", line.group()):
            spans.append((start, line.start() + cut.start()))
            start = line.start() + cut.end()
        spans.append((start, line.end()))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def _steps(text: str) -> list[tuple[int, int]]:
    """The reasoning sentences: before the final answer's sentence, with at least three words."""
    span = _final_span(text)
    end = span[0] if span else len(text)
    return [(a, b) for a, b in _sentences(text) if b < end and len(re.findall(r"[A-Za-z]+", text[a:b])) >= 3]


def _context(text: str, m: Mention) -> str:
    """Up to four words each side of `m` within its sentence, every mention of its lexeme blanked out."""
    a, b = next(((a, b) for a, b in _sentences(text) if a <= m.start < b), (0, len(text)))
    same = [x for x in find_mentions(text) if (x.cls, x.key) == (m.cls, m.key) and a <= x.start < b]
    blanked = _splice(text[a:b], [(x.start - a, x.end - a, "\0") for x in same]).replace('"', "'")
    before, _, after = blanked.partition("\0")
    words_before, lead = re.fullmatch(r"(.*?)(\S*)", before, re.DOTALL).groups()  # quotes and punctuation
    trail, words_after = re.fullmatch(r"(\S*)(.*)", after, re.DOTALL).groups()  # stay on the blank
    words = [*words_before.split()[-4:], f"{lead}___{trail}", *words_after.split()[:4]]
    return " ".join(words).replace("\0", "___")


# --------------------------------------------------------------------------- multiple choice


def choices(question: str) -> dict[str, str]:
    """Option letter -> text for lines like "A. red", "(B) blue", "C: green"; {} unless two or more."""
    found: dict[str, str] = {}
    for m in _OPTION_RE.finditer(question):
        found.setdefault(m.group(1), m.group(2))
    return found if len(found) >= 2 else {}


# "option A", "choice (B)", "answer C" in the body: the letter the reasoning settles on.
_LETTER_REF_RE = re.compile(r"(\b(?:option|choice|answer)\s+\(?)([A-Za-z])(\)?(?![\w']))", re.IGNORECASE)


def _move_choice(question: str, text: str, cls: str, key: str, value: str) -> str:
    """If the final is a letter whose option names `key`, move it to the option that reads like the
    edit, and with it the body's references to that letter ("option A", "choice (A)")."""
    options, span = choices(question), _final_span(text)
    letter = _LETTER_RE.fullmatch(text[span[0] : span[1]]) if span else None
    if span is None or letter is None or letter.group(1).upper() not in options:
        return text
    chosen = letter.group(1).upper()
    option = options[chosen]
    mentions = _value_mentions(option, cls, {key, value})
    edited = normalize_answer(_splice(option, _change_edits(mentions, cls, key, value)))
    targets = [c for c, t in options.items() if c != chosen and normalize_answer(t) == edited]
    if edited == normalize_answer(option) or not targets:
        return text
    moved = targets[0] if letter.group(1).isupper() else targets[0].lower()
    start = span[0] + letter.start(1)
    body = _LETTER_REF_RE.sub(
        lambda m: (
            m.group(1) + (moved if m.group(2).isupper() else moved.lower()) + m.group(3)
            if m.group(2).upper() == chosen
            else m.group(0)
        ),
        text[: span[0]],
    )
    return body + text[span[0] : start] + moved + text[start + 1 :]


# --------------------------------------------------------------------------- perception errors


def _change_edits(mentions: list[Mention], cls: str, key: str, value: str) -> list[Edit]:
    """Every mention of `key` becomes `value`; for antonyms, every mention of `value` becomes `key`."""
    edits = [(m.start, m.end, _render(cls, value, m.surface)) for m in mentions if (m.cls, m.key) == (cls, key)]
    if cls in ANTONYMS:
        edits += [(m.start, m.end, _render(cls, key, m.surface)) for m in mentions if (m.cls, m.key) == (cls, value)]
    return edits


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
    others = [t for t in choices(src.question).values() if _fold(t) not in taken and _readable(t)]
    misread = _misread(m.surface, rng)
    return ([misread] if _fold(misread) not in taken else []) + others


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
    numbers = {("count", str(_number_value(m.group()))) for t in (r.text, src.chosen) for m in _NUMBER_RE.finditer(t)}
    known = {(m.cls, m.key) for m in mentions} | set(in_chosen) | touched | numbers
    options = []
    for (cls, key), m in lexemes(mentions).items():
        if (cls, key) in touched or (cls, key) not in in_chosen:
            continue
        context = _context(src.chosen, in_chosen[cls, key])
        for value in _replacements(src, m, known, touched, rng):
            text = _splice(r.text, _change_edits(mentions, cls, key, value))
            text = _move_choice(src.question, text, cls, key, _fold(value) if cls == "text" else value)
            if _wrong(text, src.truth):
                change = Change(cls, m.surface, _render(cls, value, m.surface), context)
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
    for m in _EQUATION_RE.finditer(r.text):
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
        (m.start(), m.end(), [_cased(m.group(), FLIPS[m.group().lower()])])
        for m in _COMPARATIVE_RE.finditer(r.text)
        if not any(m.start() < x.end and x.start < m.end() for x in mentions)
    ]


def _negation_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    """The last copula of the conclusion (the step before the final answer): add or drop "not"."""
    steps = _steps(r.text)
    if not steps:
        return []
    a, b = steps[-1]
    copulas = list(_COPULA_RE.finditer(r.text, a, b))
    if not copulas:
        return []
    m = copulas[-1]
    if m.group(2):
        return [(m.end(1), m.end(2), [""])]
    return [(m.end(1), m.end(1), [" not"])]


def _skip_sites(r: Rewrite) -> list[tuple[int, int, list[str]]]:
    """Plain middle steps of an answer with three or more: no perturbed fact (it must stay visible),
    no equation or comparative (an earlier reasoning error must stay too)."""
    steps = _steps(r.text)
    perturbed = {(c.cls, _key(c.cls, c.perturbed)) for c in r.changes}
    sites = []
    for a, b in steps[1:-1] if len(steps) >= 3 else []:
        step = r.text[a:b]
        if any((m.cls, m.key) in perturbed for m in find_mentions(step)) or any(
            p.search(step) for p in (_EQUATION_RE, _COMPARATIVE_RE)
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
    span = _final_span(r.text)
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
    a, b = next((a, b) for a, b in _sentences(r.text) if a <= start < b or a < end <= b)
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
    return {(c.cls, _key(c.cls, c.perturbed)) for c in changes}


def _decided(r: Rewrite) -> tuple[str, str]:
    """The lexeme whose change made `r`'s final wrong: its first change."""
    c = r.changes[0]
    return c.cls, _key(c.cls, c.original)


def _wrong_finals(src: Source, options: list[Rewrite]) -> dict[tuple[str, str], float]:
    """How many different wrong final answers each decisive lexeme offers; a misreading of quoted
    text offers any number (each draw misreads it anew)."""
    option_texts = {_fold(t) for t in choices(src.question).values()}
    finals: dict[tuple[str, str], set[str]] = {}
    unbounded = set()
    for o in options:
        finals.setdefault(_decided(o), set()).add(normalize_answer(o.final))
        if o.changes[0].cls == "text" and _fold(o.changes[0].perturbed) not in option_texts:
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


# --------------------------------------------------------------------------- probes

_ASK = {
    "colour": "Which colour",
    "count": "Which number",
    "relation": "Which position",
    "size": "Which size",
    "shape": "Which shape",
    "text": "Which text",
}


def probe_question(c: Change) -> str:
    """A VQA question about the image that settles `c`: its original or its perturbed value.

    The two values are offered in alphabetical order, so a VLM that always picks one position
    is not consistent by luck.
    """
    a, b = sorted((c.original, c.perturbed), key=str.lower)
    return (
        f'Look at the image and fill the blank in "{c.context}". {_ASK[c.cls]} is right: {a} or {b}? '
        "Answer with one of them."
    )
