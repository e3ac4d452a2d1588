"""Blind checks: the image a judge is shown under `eval.image`.

A claim that a judge uses the image needs the same items judged without the image's content:
- `grey`: every image replaced by a uniform RGB (128, 128, 128) image of the same width and
  height. The vision processor resizes by size alone, so the prompt keeps its image and the
  same number of image tokens; only the pixels say nothing. PNG, so every decoded pixel is
  exactly grey (a JPEG of the same grey may come back off by one).
- `none`: the prompt carries no image at all (every protocol renders a text-only prompt; a
  text-only judge takes only these).
- `mismatched` (benchmarks of independent rows: MLLM-as-a-Judge, VL-RewardBench, Multimodal
  RewardBench): every item shown the image of another item of the same benchmark, a real
  image of a different fact, unlike grey (`mismatched_images`). A judge whose accuracy does not
  drop from the real image to the mismatched one does not use the image.

Each protocol applies `judged_image` to the images of its judged items (MLLM-as-a-Judge rows,
Mode a/b items with their probes, both sides of an MM-JudgeBias record) after the data is built
and before prompts are rendered: what is built from the real image (MM-JudgeBias perturbations,
the judge's own captions) stays the same in every mode, so a blind pass judges the same items.
A comparison that differs only in its image (MM-JudgeBias's image biases) then compares two
identical inputs.
"""

from __future__ import annotations

import hashlib
import io
import random

from PIL import Image

IMAGE_MODES = ("as_is", "grey", "none")  # eval.image
MISMATCHED = "mismatched"  # eval.blind only: needs the whole benchmark, not one image
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


def mismatched_images(images: list[bytes | None], seed: int = 0) -> list[bytes | None]:
    """For each item, the image of another item (a seeded derangement over the items that have
    an image), never the same image bytes where another image exists: item i gets the image of
    the item after it in a seeded shuffle whose first different image is taken. Items without an
    image keep none; with fewer than two distinct images nothing can be mismatched (ValueError)."""
    have = [i for i, img in enumerate(images) if img is not None]
    digests = {i: hashlib.sha256(images[i]).digest() for i in have}  # type: ignore[arg-type]
    if len(set(digests.values())) < 2:
        raise ValueError("eval.blind=mismatched: the benchmark has fewer than two distinct images to swap")
    order = list(have)
    random.Random(seed).shuffle(order)
    out: list[bytes | None] = list(images)
    for pos, i in enumerate(order):
        for step in range(1, len(order)):
            j = order[(pos + step) % len(order)]
            if digests[j] != digests[i]:
                out[i] = images[j]
                break
    return out


def shown_images(images: list[bytes | None], mode: str, seed: int = 0) -> list[bytes | None]:
    """The images a benchmark of independent rows shows under `mode`: an `eval.image` mode
    applied to each, or `mismatched` (`mismatched_images`)."""
    if mode == MISMATCHED:
        return mismatched_images(images, seed)
    return [judged_image(image, mode) for image in images]
