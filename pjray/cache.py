"""Where pjray keeps what it builds once per machine (base judges, training's scene data)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PJRAY_CACHE`, else `$XDG_CACHE_HOME/pjray`, else `~/.cache/pjray`."""
    if os.environ.get("PJRAY_CACHE"):
        return Path(os.environ["PJRAY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pjray"
