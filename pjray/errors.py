"""What a failed command tells its user: one line, and an exit code that says whose fault it was.

`InputError` is the base of every error about what the user handed in (a config key, a path, a
row of a data file): its message already names the key, file or row, so the user sees it alone,
`pjray: <what>: <message>`, with exit code 2. Anything else is a bug in pjray (or its stack): exit
code 1, its type and first line, and a hint that `--debug` shows the traceback.

Errors raised inside Ray workers reach the driver wrapped (`RayTaskError`, an actor that died in
its constructor); `explain` looks through the wrapping to the error that was raised.
"""

from __future__ import annotations

import importlib

EXIT_INPUT = 2
EXIT_BUG = 1

DEBUG_HINT = "rerun with --debug (or PJRAY_DEBUG=1) for the traceback"


class InputError(ValueError):
    """Bad input from the user; the message names the key, file or row and says what is wrong."""

    what = "bad input"


def causes(err: BaseException) -> list[BaseException]:
    """`err` and what it wraps, outermost first: Ray's `RayTaskError.cause`, then `__cause__`
    (Ray Data re-raises a worker's error from its own)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        wrapped = getattr(current, "cause", None)
        current = wrapped if isinstance(wrapped, BaseException) else current.__cause__
    return chain


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def pjray_input_error(qualified_name: str) -> type[InputError] | None:
    """The pjray `InputError` class a traceback names (`pjray.data.sources.DataError`), if any."""
    module, _, name = qualified_name.rpartition(".")
    if not module.startswith("pjray."):
        return None
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, InputError) else None


def explain(err: BaseException) -> tuple[int, str]:
    """(exit code, the one line for the console) for an error that ended a command."""
    chain = causes(err)
    # The innermost: Ray's wrapper subclasses its cause, but its text is the remote traceback.
    for e in reversed(chain):
        if isinstance(e, InputError):
            prefix = f"{e.what}: " if e.what else ""
            return EXIT_INPUT, f"pjray: {prefix}{first_line(str(e))}"
    root = chain[-1]
    if getattr(root, "actor_init_failed", False):
        # An actor whose constructor raised: Ray keeps only the text, whose last line is the
        # original `module.Type: message`.
        message = last_line(str(root))
        cls, _, text = message.partition(": ")
        input_error = pjray_input_error(cls)
        if input_error is not None:
            prefix = f"{input_error.what}: " if input_error.what else ""
            return EXIT_INPUT, f"pjray: {prefix}{text}"
    else:
        message = f"{type(root).__name__}: {first_line(str(root))}"
    return EXIT_BUG, f"pjray: internal error: {message} ({DEBUG_HINT})"
