"""Wall time per phase of a training step, and the compute time the workers measured in it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from pjray.types import Timed

# Phases whose work runs in workers that time it themselves (Timed answers).
COMPUTE_PHASES = ("gen", "reward", "ref", "old_log_prob", "update")

T = TypeVar("T")


class Timer:
    """Accumulates wall time per phase (`with timer("gen"): ...` -> timing_s/gen) and, for the
    phases in COMPUTE_PHASES, the compute seconds the workers measured (`timer.unwrap`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.compute: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def unwrap(self, phase: str, answers: list[Timed[T]]) -> list[T]:
        """The values of one call to several workers at once; adds the slowest worker's compute
        seconds to `phase`, since the driver waits for that one."""
        self.compute[phase] += max((a.compute_s for a in answers), default=0.0)
        return [a.value for a in answers]

    def metrics(self) -> dict[str, float]:
        """timing_s/<phase> (wall) for every phase; for each phase of COMPUTE_PHASES that ran,
        timing_s/<phase>_compute and timing_s/<phase>_overhead (wall - compute: Ray dispatch,
        transfers, driver work inside the phase); timing_s/compute, their sum; and
        timing_s/ray_overhead = timing_s/step - timing_s/compute. With trainer.max_staleness > 0,
        gen's wall time is the wait for a batch generated during earlier steps, so its overhead
        goes negative by the generation it hid."""
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        ran = [p for p in COMPUTE_PHASES if p in self.seconds]
        for phase in ran:
            out[f"timing_s/{phase}_compute"] = self.compute[phase]
            out[f"timing_s/{phase}_overhead"] = self.seconds[phase] - self.compute[phase]
        out["timing_s/compute"] = sum(self.compute[p] for p in ran)
        out["timing_s/ray_overhead"] = self.seconds["step"] - out["timing_s/compute"]
        return out
