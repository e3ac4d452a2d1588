"""The errors a bad config raises, and the rule a field carries beside it (`opt`).

`opt(default, choices=..., gt=...)` writes a field's own rule (`Check`) into its metadata, so the
rule stands beside the field; `check_fields` checks every such rule of a config, nested sections
included, and the option reference lists it. Rules that read several fields of a section are its
`check()` method; rules that read several sections are in `pjray.config.cross`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from pjray.errors import InputError


class ConfigError(InputError):
    """A bad config: the message names the offending key."""

    what = "bad config"


class PathError(ConfigError):
    """A path the config names does not exist or is not what it must be; the message is
    `<key>: <path>: <why>`, complete on its own."""

    what = ""


T = TypeVar("T")
CHECK = "check"  # the metadata key of a field's Check


@dataclass(frozen=True)
class Check:
    """The values one field takes: one of `choices`, or within the bounds (gt, ge, le, lt).
    Written beside the field with `opt`; `validate` checks it, the option reference lists it."""

    choices: tuple[Any, ...] = ()
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False  # an int field: its bounds read as a range of ints (2..26)
    why: str = ""  # said after the rule when a value breaks it

    def passes(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def rule(self) -> str:
        """The bounds in words: `> 0`, `>= 0`, `in (0, 1]`, `in 2..26`; empty for choices."""
        if self.integer and self.ge is not None and self.le is not None:
            return f"in {self.ge:g}..{self.le:g}"
        low = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else ""
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else ""
        if low and high:
            return f"in {low}, {high}"
        bounds = ((">", self.gt), (">=", self.ge), ("<=", self.le), ("<", self.lt))
        return " ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)

    def error(self, key: str, value: Any) -> str:
        rule = f"expected one of {', '.join(map(str, self.choices))}" if self.choices else f"must be {self.rule()}"
        return f"{key}={value!r}: {rule}" + (f" ({self.why})" if self.why else "")


def opt(
    default: T,
    *,
    choices: Sequence[Any] = (),
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
) -> T:
    """A field with its default and the values it takes (`Check`), so the rule stands beside
    the field it constrains."""
    check = Check(tuple(choices), gt, ge, le, lt, integer=type(default) is int, why=why)
    return field(default=default, metadata={CHECK: check})


def check_fields(section: Any, prefix: str) -> None:
    """The rule `opt` wrote beside each field, nested sections included."""
    for f in fields(section):
        key, value = f"{prefix}{f.name}", getattr(section, f.name)
        if is_dataclass(value):
            check_fields(value, f"{key}.")
        elif CHECK in f.metadata and not f.metadata[CHECK].passes(value):
            raise ConfigError(f.metadata[CHECK].error(key, value))


def check_resources(section: str, resources: dict[str, float]) -> None:
    """`<section>.resources`: custom Ray resources a role's bundles ask for (rollout, learner)."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not amount > 0:
            raise ConfigError(
                f"{section}.resources.{name}={amount}: custom Ray resources only (CPUs and GPUs "
                f"have their own keys), each > 0"
            )
