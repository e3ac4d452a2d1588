"""The image side of MM-JudgeBias's perturbations (`pjray.eval.mm_judgebias`), with PIL only: a
black image of the same size, a meaning-preserving transform of one family, the query's keywords
written onto the image."""

from __future__ import annotations

import io
import random
import re

from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageFont

__all__ = ["TRANSFORM_FAMILIES", "black_image", "insert_text", "query_keywords", "visual_transform"]

TRANSFORM_FAMILIES = ("geometric", "photometric", "quality", "spatial")


def _open(image: bytes) -> Image.Image:
    with Image.open(io.BytesIO(image)) as img:
        return img.convert("RGB")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def black_image(image: bytes | None, size: tuple[int, int] = (448, 448)) -> bytes:
    """An all-black RGB image of the same size as `image` (or `size` when there is none)."""
    if image is not None:
        size = _open(image).size
    return _png(Image.new("RGB", size, (0, 0, 0)))


def visual_transform(image: bytes, rng: random.Random, family: str | None = None) -> tuple[bytes, str]:
    """A meaning-preserving transform of one family (drawn by `rng` when None).

    geometric: rotation by 3-8 degrees either way, canvas kept, corners filled with the edge
    colour. photometric: brightness, contrast and saturation each scaled by 0.75-0.9 or 1.1-1.25.
    quality: JPEG at quality 20-35 then a 0.6-1.0 px Gaussian blur. spatial: the image shrunk to
    80-90% and placed off-centre on a canvas of the original size. Never a flip: it would swap
    left and right, which many questions ask about. Returns (PNG bytes, description).
    """
    family = family or rng.choice(TRANSFORM_FAMILIES)
    img = _open(image)
    corner = img.getpixel((0, 0))
    if family == "geometric":
        angle = rng.uniform(3, 8) * rng.choice((-1, 1))
        out, desc = img.rotate(angle, resample=Image.Resampling.BICUBIC, fillcolor=corner), f"rotate {angle:.1f} deg"
    elif family == "photometric":
        factors = [rng.choice((rng.uniform(0.75, 0.9), rng.uniform(1.1, 1.25))) for _ in range(3)]
        out = ImageEnhance.Brightness(img).enhance(factors[0])
        out = ImageEnhance.Contrast(out).enhance(factors[1])
        out = ImageEnhance.Color(out).enhance(factors[2])
        desc = "brightness {:.2f} contrast {:.2f} saturation {:.2f}".format(*factors)
    elif family == "quality":
        quality, radius = rng.randint(20, 35), rng.uniform(0.6, 1.0)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        out = _open(buf.getvalue()).filter(ImageFilter.GaussianBlur(radius))
        desc = f"jpeg q{quality} blur {radius:.2f}"
    elif family == "spatial":
        scale = rng.uniform(0.8, 0.9)
        w, h = img.size
        small = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
        out = Image.new("RGB", (w, h), corner)
        dx, dy = rng.randint(0, w - small.width), rng.randint(0, h - small.height)
        out.paste(small, (dx, dy))
        desc = f"scale {scale:.2f} at ({dx}, {dy})"
    else:
        raise ValueError(f"unknown transform family {family!r}; expected one of {TRANSFORM_FAMILIES}")
    return _png(out), f"{family}: {desc}"


_STOPWORDS = frozenset(
    "a an the is are was were be of in on at to for from by with and or what which who whom whose "
    "how many much does do did this that these those there it its as image picture shown show "
    "in into than then if please about".split()
)


def query_keywords(query: str, k: int = 3) -> list[str]:
    """Up to `k` content words of the query: stopwords dropped, longest first, ties in order."""
    words = [w for w in re.findall(r"[A-Za-z0-9]+", query) if w.lower() not in _STOPWORDS and len(w) > 2]
    unique = list(dict.fromkeys(words))
    return sorted(unique, key=lambda w: -len(w))[:k]


def insert_text(image: bytes, text: str) -> bytes:
    """Draw `text` onto the image: black letters on a white band along the bottom edge, so the
    overlay is legible on any background and covers as little of the content as possible."""
    img = _open(image)
    draw = ImageDraw.Draw(img)
    size = max(10, img.height // 12)
    try:
        font = ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizes
        font = ImageFont.load_default()
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    pad = 2
    band_top = img.height - (bottom - top) - 2 * pad
    draw.rectangle([0, band_top, img.width, img.height], fill=(255, 255, 255))
    draw.text((pad - left, band_top + pad - top), text, fill=(0, 0, 0), font=font)
    return _png(img)
