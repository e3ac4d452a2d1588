"""Encoded image bytes as the models take them."""

from __future__ import annotations

import io

import PIL.Image


def decode_image(b: bytes) -> PIL.Image.Image:
    """Decode encoded image bytes (PNG, JPEG, ...) into an RGB PIL image; ValueError if corrupt."""
    if not isinstance(b, (bytes, bytearray, memoryview)):
        raise ValueError(f"image must be encoded bytes, got {type(b).__name__}")
    data = bytes(b)
    if not data:
        raise ValueError("could not decode image: 0 bytes")
    try:
        with PIL.Image.open(io.BytesIO(data)) as img:
            img.load()  # open() is lazy: force the decode so truncated data fails here
            return img.convert("RGB")
    except (PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"could not decode image ({len(data)} bytes, starting {data[:8]!r}): {e}") from e
