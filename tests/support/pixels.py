"""Scene facts measured from pixels alone (shared by the scene and image-swap tests)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy import ndimage

from pjray.data.scenes import PALETTE, SIZES, size_radius


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@dataclass
class Blob:
    """One shape as measured from pixels alone."""

    color: str
    shape: str
    width: int  # bounding-box width, pixels
    cx: float  # centroid
    cy: float
    cell: tuple[int, int]


def measure(png: bytes) -> list[Blob]:
    """Find every flat-coloured region and classify it without looking at the scene."""
    img = pixels(png)
    size = img.shape[1]
    blobs = []
    for name, rgb in PALETTE.items():
        labels, _ = ndimage.label((img == rgb).all(-1))
        for k, box in enumerate(ndimage.find_objects(labels), start=1):
            ys, xs = np.nonzero(labels[box] == k)
            ys, xs = ys + box[0].start, xs + box[1].start
            width, height = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
            fill = len(xs) / (width * height)
            # A square fills its box, a circle ~pi/4 of it, a triangle ~1/2.
            shape = "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"
            cx, cy = xs.mean(), ys.mean()
            blobs.append(Blob(name, shape, int(width), cx, cy, (int(cy * 3 // size), int(cx * 3 // size))))
    return blobs


def measured_size(blob: Blob, image_size: int) -> str:
    """The size whose drawn width is nearest the blob's."""
    return min(SIZES, key=lambda s: abs(blob.width - (2 * size_radius(s, image_size) + 1)))
