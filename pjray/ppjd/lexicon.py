"""The lexicon of the PPJD rules backend for rows without scene facts: its word lists, the
records of an edit, and how a free-text answer's perception words are found and rewritten.

This is the vocabulary the "rewrite rejecteds" step (`pjray.ppjd.rewrites`) edits answers with,
for MMPR, generic JSONL / parquet rows: a question, a chosen answer that ends in a final answer
(`\\boxed{...}` or a "Final Answer:" line), and the ground truth. No model is involved: every
edit is a word-level rewrite found with a small lexicon, recorded exactly (`Rewrite`).

- A *mention* (`find_mentions`) is a word of one perception class: colour, count, spatial
  relation, size, shape, or text read from the image (a quoted string).
- Text surgery (`splice`, `render_value`, `sentence_spans`, `step_spans`) rewrites mentions in
  place, keeping case and articles; `choices` and `move_choice` keep a multiple-choice answer's
  letter and option text in step.
- `probe_question` asks the VQA check about one changed fact.

Limits: these are word lists, not understanding. A lexicon word in another sense is edited as an
attribute unless it is a listed collocation, and a fact stated without a lexicon word is
invisible.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pjray.ppjd.perturb import final_answer, normalize_answer

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
NUMBER_RE = re.compile(rf"(?<![\w.,:/^-])(?:{_NUMBER})(?![\w:/^-]|[.,]\d)", re.IGNORECASE)
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
EQUATION_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([-+*/×÷x])\s*(\d+(?:\.\d+)?)\s*=\s*(\d+(?:\.\d+)?)(?!\d|\.\d)")
COMPARATIVE_RE = re.compile(
    r"\b(?:(?:more|less|fewer|greater|higher|lower)(?=(?:\s+[\w-]+){0,2}\s+than\b)|"
    r"(?:most|least|highest|lowest|maximum|minimum|(?:in|de)creas(?:e|es|ed|ing)))\b",
    re.IGNORECASE,
)
COPULA_RE = re.compile(r"\b(is|are|was|were)\b(\s+not\b)?", re.IGNORECASE)

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
        return {(c.cls, key_of(c.cls, s)) for c in self.changes for s in (c.original, c.perturbed)}

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


def fold(s: str) -> str:
    return " ".join(s.lower().split())


def number_value(s: str) -> int:
    return int(s) if s.isdigit() else NUMBER_WORDS.index(s.lower())


def key_of(cls: str, surface: str) -> str:
    """The canonical value of a surface form of class `cls`."""
    if cls == "count":
        return str(number_value(surface))
    if cls == "text":
        return fold(surface)
    return WORDS[fold(surface)][1]


def readable(s: str) -> bool:
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
        if readable(s):
            keys.setdefault(fold(s))
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
        float(number_value(m.group()) if m.group()[0].isalpha() else m.group())
        for i, m in enumerate(operands)
        if i in joined or i - 1 in joined or _RESULT_RE.search(text, 0, m.start())
    }


def _count_mentions(text: str) -> list[Mention]:
    """Number tokens 2..20 of values that count something somewhere and never take part in arithmetic."""
    arithmetic = _arithmetic_values(text)
    tokens = [
        (m, number_value(m.group()))
        for m in NUMBER_RE.finditer(text)
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
    words = [Mention(*WORDS[fold(m.group())], m.start(), m.end(), m.group()) for m in _WORD_RE.finditer(text)]
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
            Mention(cls, str(number_value(m.group())), m.start(), m.end(), m.group()) for m in NUMBER_RE.finditer(text)
        ]
    else:
        found = [Mention(*WORDS[fold(m.group())], m.start(), m.end(), m.group()) for m in _WORD_RE.finditer(text)]
    return [m for m in found if m.cls == cls and m.key in keys]


# --------------------------------------------------------------------------- text surgery


def cased(model: str, word: str) -> str:
    """`word` in the case of `model`: "RED" -> "BLUE", "Red" -> "Blue", "red" -> "blue"."""
    if len(model) > 1 and model.isupper():
        return word.upper()
    if model.islower():
        return word.lower()
    if model[:1].isupper():
        return word[:1].upper() + word[1:]
    return word


def render_value(cls: str, value: str, surface: str) -> str:
    """`value` written in the form of the mention `surface`: digits or words, singular or plural, case."""
    if cls == "count":
        word = value if surface.isdigit() else NUMBER_WORDS[int(value)]
    elif cls == "shape" and fold(surface).endswith("s"):
        word = value + "s"
    else:
        word = value
    return cased(surface, word)


def splice(text: str, edits: list[Edit]) -> str:
    """Apply non-overlapping edits; an "a"/"an" right before an edit is fixed to fit the new word."""
    articles = []
    for start, _, new in edits:
        article = _ARTICLE_RE.search(text, max(0, start - 4), start)
        if article and new[:1].isalpha():
            want = "an" if new[0].lower() in "aeiou" else "a"
            articles.append((article.start(1), article.end(1), cased(article.group(1), want)))
    out = text
    for start, end, new in sorted([*edits, *articles], reverse=True):
        out = out[:start] + new + out[end:]
    return out


def final_span(text: str) -> tuple[int, int] | None:
    """Where the final answer stands: its last occurrence, since the final ends the answer."""
    final = final_answer(text)
    if final is None:
        return None
    start = text.rfind(final)
    return start, start + len(final)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence: lines, cut after ., ! or ? followed by a space."""
    spans = []
    for line in re.finditer(r"[^\n]+", text):
        start = line.start()
        for cut in re.finditer(r"(?<=[.!?])\s+", line.group()):
            spans.append((start, line.start() + cut.start()))
            start = line.start() + cut.end()
        spans.append((start, line.end()))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def step_spans(text: str) -> list[tuple[int, int]]:
    """The reasoning sentences: before the final answer's sentence, with at least three words."""
    span = final_span(text)
    end = span[0] if span else len(text)
    return [(a, b) for a, b in sentence_spans(text) if b < end and len(re.findall(r"[A-Za-z]+", text[a:b])) >= 3]


def context_of(text: str, m: Mention) -> str:
    """Up to four words each side of `m` within its sentence, every mention of its lexeme blanked out."""
    a, b = next(((a, b) for a, b in sentence_spans(text) if a <= m.start < b), (0, len(text)))
    same = [x for x in find_mentions(text) if (x.cls, x.key) == (m.cls, m.key) and a <= x.start < b]
    blanked = splice(text[a:b], [(x.start - a, x.end - a, "\0") for x in same]).replace('"', "'")
    before, _, after = blanked.partition("\0")
    words_before, lead = re.fullmatch(r"(.*?)(\S*)", before, re.DOTALL).groups()  # quotes and punctuation
    trail, words_after = re.fullmatch(r"(\S*)(.*)", after, re.DOTALL).groups()  # stay on the blank
    words = [*words_before.split()[-4:], f"{lead}___{trail}", *words_after.split()[:4]]
    return " ".join(words).replace("\0", "___")


def change_edits(mentions: list[Mention], cls: str, key: str, value: str) -> list[Edit]:
    """Every mention of `key` becomes `value`; for antonyms, every mention of `value` becomes `key`."""
    edits = [(m.start, m.end, render_value(cls, value, m.surface)) for m in mentions if (m.cls, m.key) == (cls, key)]
    if cls in ANTONYMS:
        edits += [
            (m.start, m.end, render_value(cls, key, m.surface)) for m in mentions if (m.cls, m.key) == (cls, value)
        ]
    return edits


# --------------------------------------------------------------------------- multiple choice


def choices(question: str) -> dict[str, str]:
    """Option letter -> text for lines like "A. red", "(B) blue", "C: green"; {} unless two or more."""
    found: dict[str, str] = {}
    for m in _OPTION_RE.finditer(question):
        found.setdefault(m.group(1), m.group(2))
    return found if len(found) >= 2 else {}


# "option A", "choice (B)", "answer C" in the body: the letter the reasoning settles on.
_LETTER_REF_RE = re.compile(r"(\b(?:option|choice|answer)\s+\(?)([A-Za-z])(\)?(?![\w']))", re.IGNORECASE)


def move_choice(question: str, text: str, cls: str, key: str, value: str) -> str:
    """If the final is a letter whose option names `key`, move it to the option that reads like the
    edit, and with it the body's references to that letter ("option A", "choice (A)")."""
    options, span = choices(question), final_span(text)
    letter = _LETTER_RE.fullmatch(text[span[0] : span[1]]) if span else None
    if span is None or letter is None or letter.group(1).upper() not in options:
        return text
    chosen = letter.group(1).upper()
    option = options[chosen]
    mentions = _value_mentions(option, cls, {key, value})
    edited = normalize_answer(splice(option, change_edits(mentions, cls, key, value)))
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
