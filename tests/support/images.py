"""Test images: encoded PNGs of a given size that differ per seed."""

from __future__ import annotations

import io
import random

import PIL.Image


def noisy_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of one seeded colour with 40 seeded pixels of others (distinct images per seed)."""
    rng = random.Random(seed)
    img = PIL.Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(40):
        img.putpixel((rng.randrange(width), rng.randrange(height)), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
