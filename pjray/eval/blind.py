"""Blind checks: the image a judge is shown under `eval.image`.

A claim that a judge uses the image needs the same items judged without the image's content:
- `grey`: every image replaced by a uniform RGB (128, 128, 128) image of the same width and
  height. The vision processor resizes by size alone, so the prompt keeps its image and the
  same number of image tokens; only the pixels say nothing. PNG, so every decoded pixel is
  exactly grey (a JPEG of the same grey may come back off by one).
- `none`: the prompt carries no image at all (every protocol renders a text-only prompt; a
  text-only judge takes only these).

Each protocol applies `judged_image` to the images of its judged items (MLLM-as-a-Judge rows,
Mode a/b items with their probes, both sides of an MM-JudgeBias record) after the data is built
and before prompts are rendered: what is built from the real image (MM-JudgeBias perturbations,
the judge's own captions) stays the same in every mode, so a blind pass judges the same items.
A comparison that differs only in its image (MM-JudgeBias's image biases) then compares two
identical inputs.
"""

from __future__ import annotations

import io

from PIL import Image

IMAGE_MODES = ("as_is", "grey", "none")  # eval.image
GREY = (128, 128, 128)


def grey_image(image: bytes) -> bytes:
    """A uniform grey PNG (RGB `GREY`) of the width and height of the encoded `image`."""
    with Image.open(io.BytesIO(image)) as img:
        size = img.size  # the header's size: the pixels need not be decoded
    buf = io.BytesIO()
    Image.new("RGB", size, GREY).save(buf, format="PNG")
    return buf.getvalue()


def judged_image(image: bytes | None, mode: str) -> bytes | None:
    """The image the judge is shown for `image` under `eval.image=mode` (None: no image)."""
    if mode == "as_is":
        return image
    if mode == "grey":
        return None if image is None else grey_image(image)
    if mode == "none":
        return None
    raise ValueError(f"unknown image mode {mode!r}; expected one of {IMAGE_MODES}")
