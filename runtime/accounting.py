"""Byte accounting per memory tier and kind, so memory claims can be checked.

Every runtime allocation of model state goes through :func:`add` / :func:`sub` (or :func:`set_bytes`
for totals recomputed in one go, such as optimizer state). ``memory_stats()`` then answers, per tier
(``device``, ``cpu``, ``nvme``) and kind (``param``, ``grad``, ``optim``, ``gathered``), the current and
peak bytes. The counters are process-wide on purpose: they describe this process's memory, as
``torch.cuda.memory_stats`` does, and hold no compile state.
"""

from __future__ import annotations

import threading
from typing import Dict

TIERS = ("device", "cpu", "nvme")
KINDS = ("param", "grad", "optim", "gathered")

_lock = threading.Lock()
_current: Dict[tuple[str, str], int] = {}
_peak: Dict[tuple[str, str], int] = {}


def _check(tier: str, kind: str) -> None:
    if tier not in TIERS or kind not in KINDS:
        raise ValueError(f"unknown memory tier/kind {tier!r}/{kind!r}; tiers {TIERS}, kinds {KINDS}")


def add(tier: str, kind: str, nbytes: int) -> None:
    """Record ``nbytes`` more bytes of ``kind`` resident on ``tier``."""
    _check(tier, kind)
    with _lock:
        key = (tier, kind)
        cur = _current.get(key, 0) + int(nbytes)
        _current[key] = cur
        if cur > _peak.get(key, 0):
            _peak[key] = cur


def sub(tier: str, kind: str, nbytes: int) -> None:
    """Record that ``nbytes`` bytes of ``kind`` left ``tier``."""
    add(tier, kind, -int(nbytes))


def set_bytes(tier: str, kind: str, nbytes: int) -> None:
    """Set the current bytes of ``kind`` on ``tier`` (for totals recomputed as a whole)."""
    _check(tier, kind)
    with _lock:
        key = (tier, kind)
        _current[key] = int(nbytes)
        if nbytes > _peak.get(key, 0):
            _peak[key] = int(nbytes)


def current(tier: str, kind: str) -> int:
    _check(tier, kind)
    return _current.get((tier, kind), 0)


def memory_stats() -> Dict[str, Dict[str, Dict[str, int]]]:
    """Current and peak bytes: ``stats[tier][kind] == {"current": int, "peak": int}``.

    ``gathered`` is the bytes of full (all-gathered) parameters materialized on the compute device;
    the other kinds are the bytes of this rank's shards (parameters incl. compute-dtype copies,
    fp32 gradients, optimizer state) held on each tier.
    """
    with _lock:
        return {
            tier: {
                kind: {"current": _current.get((tier, kind), 0), "peak": _peak.get((tier, kind), 0)}
                for kind in KINDS
            }
            for tier in TIERS
        }


def reset_peak_memory_stats() -> None:
    """Set every peak to the current value (like ``torch.cuda.reset_peak_memory_stats``)."""
    with _lock:
        for key in list(_peak):
            _peak[key] = _current.get(key, 0)
