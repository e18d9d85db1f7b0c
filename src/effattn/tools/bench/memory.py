"""Peak memory of one call, over the memory that existed before it.

CPU: the process's resident set. Linux lets a process reset its own high-water mark
(``echo 5 > /proc/self/clear_refs`` sets VmHWM to the current VmRSS), so the peak of one call is
``VmHWM after - VmRSS before``. That is only honest in a process that has run nothing else large
(a freed buffer that the allocator keeps would be reused without raising the mark), which is why
:mod:`effattn.tools.bench.speed` measures every configuration in a fresh worker process. Where
/proc is missing (macOS) the rise of ``ru_maxrss`` is used instead, which undercounts when an
earlier peak was higher.

CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus ``memory_allocated`` before: the
tensors the call creates, excluding the allocator's cache.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

MiB = 2**20
_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _maxrss_bytes() -> int:
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Current resident set size (the running peak where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else _maxrss_bytes()


def reset_peak_rss() -> bool:
    """Set the RSS high-water mark to the current RSS; False where the OS does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Resident set high-water mark (since the last :func:`reset_peak_rss`)."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _maxrss_bytes()


class PeakMemory:
    """Context manager: ``peak_bytes`` is the peak memory of the block over the memory before it.

    >>> with PeakMemory("cpu") as mem:
    ...     x = torch.ones(2**22)
    >>> mem.peak_bytes >= 0
    True
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._base = rss_bytes()
            if not reset_peak_rss():
                self._base = peak_rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        self.read()

    def read(self) -> int:
        """The peak so far, over the memory before the block; also stored in ``peak_bytes``.

        Inside the block it reads the running peak, e.g. at every report point of a decode.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = peak_rss_bytes()
        self.peak_bytes = max(0, peak - self._base)
        return self.peak_bytes


def cap_memory(device: torch.device | str, mib: float) -> None:
    """Let this process allocate at most ``mib`` MiB more than it holds now.

    CPU: the address-space limit (RLIMIT_AS) is set to the current size plus ``mib``, so a larger
    allocation fails with an ordinary allocation error instead of swapping or waking the OOM
    killer. CUDA: the allocator's per-process fraction of the device.
    """
    device = torch.device(device)
    extra = int(mib * MiB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (used + extra) / total), device)
        return
    kib = _status_kib("VmSize")
    if kib is None:
        raise OSError("a CPU memory cap needs /proc/self/status (Linux)")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = kib * 1024 + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def is_oom(err: BaseException) -> bool:
    """Is ``err`` an allocation failure (CPU or CUDA)?"""
    if isinstance(err, MemoryError):
        return True
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text or "cannot allocate" in text
    )
