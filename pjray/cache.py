"""Where pjray keeps what it builds once per machine (base judges, training's scene data), the
hash of pjray's code its entries are keyed by, and a write no reader sees half of."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """`$PJRAY_CACHE`, else `$XDG_CACHE_HOME/pjray`, else `~/.cache/pjray`."""
    if os.environ.get("PJRAY_CACHE"):
        return Path(os.environ["PJRAY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pjray"


@functools.cache
def code_hash() -> str:
    """A hash of every Python file of the installed pjray package (names and contents)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temporary sibling, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)
