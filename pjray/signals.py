"""Ctrl-C and SIGTERM (`ray job stop`, a scheduler's preemption) as a request to stop cleanly.

While a `StopRequest` is installed, the first SIGINT or SIGTERM raises `Interrupted` at once,
except inside `deferred()`: there it only records the request, and the code that deferred it (the
training loop) stops at its next safe point, writes a checkpoint and then raises `Interrupted`
itself. A second signal always raises at once. `Interrupted` is a `KeyboardInterrupt`, so code
that cleans up on Ctrl-C (`finally`, context managers) cleans up on SIGTERM too.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Stopped by a signal; `message` says what was saved and how to continue."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(signum, message)
        self.signum = signum
        self.message = message or f"interrupted ({signal.Signals(signum).name})"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopRequest:
    """Installs the handlers for SIGINT and SIGTERM while entered (main thread only: elsewhere
    Python delivers no signals, and the defaults stay)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False
        self.previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.requested or not self.deferring:
            # Kept, so that `check` raises it again if something swallows it on its way (Python
            # drops an exception raised while it runs a `__del__`).
            self.signum = signum
            raise Interrupted(signum)
        self.signum = signum
        log.warning(
            "%s: stopping after this step with a checkpoint; send it again to stop at once",
            signal.Signals(signum).name,
        )

    def check(self) -> None:
        """Raise a signal that was raised outside `deferred()` and did not stop the caller."""
        if self.signum is not None and not self.deferring:
            raise Interrupted(self.signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals inside only request a stop. A signal raised before it that did not stop the
        caller (set-up's, lost on its way) is raised on entry."""
        self.check()
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
