"""What a benchmark or a cost profile records about the CPU it ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."), else the architecture.
    `platform.processor()` is empty on Linux, so runs on two kinds of x86_64 machine would be
    recorded alike, though their per-step costs differ by a few times."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()
