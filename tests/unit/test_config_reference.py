"""The option reference in configs/README.md is the schema's: every key, type, default, allowed
values and comment, regenerated and compared (`python -m pjray.config_reference` rewrites it)."""

from __future__ import annotations

import dataclasses
import re

from pjray import config
from pjray.config_reference import README, committed, field_comments, reference


def _keys(cls: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out += (
            _keys(type(default), f"{prefix}.{f.name}") if dataclasses.is_dataclass(default) else [f"{prefix}.{f.name}"]
        )
    return out


def test_the_committed_reference_is_the_schemas() -> None:
    assert committed(README.read_text(encoding="utf-8")) == reference(), "run `python -m pjray.config_reference`"


def test_every_key_is_in_the_reference_once() -> None:
    keys = [k for s in dataclasses.fields(config.Config) for k in _keys(type(s.default_factory()), s.name)]
    listed = re.findall(r"^\| `([\w.]+)` \|", reference(), re.M)
    assert listed == keys and len(keys) > 150


def test_comments_are_read_above_and_beside_a_field() -> None:
    source = "class A:\n    # first line\n    # second line\n    x: int = 1  # beside\n    y: int = 2\n"
    assert field_comments(source) == {("A", "x"): "first line second line beside", ("A", "y"): ""}
