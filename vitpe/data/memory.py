"""The machine's memory, read where data is chosen (held or streamed) and where a step's size is checked."""
from __future__ import annotations

import os

__all__ = ["host_memory_available", "gib"]


def host_memory_available() -> int:
    """Bytes the system can give a new computation: Linux's MemAvailable, else what the machine has in all."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: float) -> str:
    """Bytes for a message: GiB with one decimal, MiB below a tenth of one (so a small plan is not "0.0 GiB")."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"
