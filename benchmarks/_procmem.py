"""Shared by the benchmarks: the process's own peak-RSS reset (Linux ``/proc/self/clear_refs``)."""

from __future__ import annotations


def reset_hwm() -> bool:
    """Reset this process's ``VmHWM`` (and ``ru_maxrss``) to its current RSS (Linux >= 4.0), so a
    phase's peak can be read on its own; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
