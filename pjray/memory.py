"""Peak memory of this process, as every actor role reports it (`memory/<role>_peak_mib` per step).

Host: the peak resident set size since the process started (`getrusage`; Linux counts KiB).
Device: the peak of PyTorch's CUDA allocator, when this process uses a GPU; 0 otherwise.
"""

from __future__ import annotations

import resource
import sys


def peak_memory_mib() -> dict[str, float]:
    """{"host": peak RSS in MiB, "gpu": peak CUDA memory allocated by torch in MiB}."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # macOS counts bytes
    gpu = 0.0
    torch = sys.modules.get("torch")  # a process that never imported torch used no GPU through it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = torch.cuda.max_memory_allocated() / 2**20
    return {"host": host, "gpu": gpu}


def peak_memory_metrics(peaks: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """memory/<role>_peak_mib (host, the largest actor of the role) and, where a role uses a GPU,
    memory/<role>_gpu_peak_mib, from each role's actors' `peak_memory_mib` answers."""
    metrics = {}
    for role, answers in peaks.items():
        host, gpu = max(a["host"] for a in answers), max(a["gpu"] for a in answers)
        metrics[f"memory/{role}_peak_mib"] = host
        if gpu:
            metrics[f"memory/{role}_gpu_peak_mib"] = gpu
    return metrics
