"""Checks on PPJD rewrites shared by the unit and integration tests."""

from __future__ import annotations

import difflib
import re

from pjray.data.scenes import COLORS, LOCATIONS, SHAPES, SIZE_FRACTION, SIZES

# Words a perception-only rewrite of a scene answer may change: attribute values, and the
# derived words (counts, relations, yes/no) that follow from them.
ATTRIBUTE_WORDS = (
    set(COLORS)
    | set(SHAPES)
    | set(SIZES)
    | {w for loc in LOCATIONS for w in loc.split()}
    | {*SIZE_FRACTION.values(), "yes", "no", "left", "right", "above", "below", "higher", "lower", *map(str, range(10))}
)


def only_attribute_words_differ(chosen: str, candidate: str, words: set[str] = ATTRIBUTE_WORDS) -> bool:
    """Same steps (sentences) in the same order, each differing at most in `words`."""
    split = lambda t: [s for s in re.split(r"(?<=[.])\s+|\n", t) if s]  # noqa: E731
    a_steps, b_steps = split(chosen), split(candidate)
    if len(a_steps) != len(b_steps):
        return False
    for x, y in zip(a_steps, b_steps):
        a, b = x.split(), y.split()
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag != "equal" and not {w.strip(".?,:").lower() for w in a[i1:i2] + b[j1:j2]} <= words:
                return False
    return True
