"""Byte accounting per memory tier and kind, so memory claims can be checked.

Every runtime allocation of model state goes through :func:`add` / :func:`sub` (or :func:`set_bytes`
for totals recomputed in one go, such as optimizer state). ``memory_stats()`` then answers, per tier
(``device``, ``cpu``, ``nvme``) and kind (``param``, ``grad``, ``optim``, ``gathered``), the current and
peak bytes. The counters are process-wide on purpose: they describe this process's memory, as
``torch.cuda.memory_stats`` does, and hold no compile state.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional

TIERS = ("device", "cpu", "nvme")
KINDS = ("param", "grad", "optim", "gathered", "grad_buffer", "materialized")

_lock = threading.Lock()
_budget: Optional[int] = None
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
    ``grad_buffer`` the full gradients handed to ``reduce_grad`` (live until reduced);
    ``materialized`` their sum, the parameter + gradient working memory the paper's tiling bounds.
    ``param``, ``grad`` and ``optim`` are the bytes of this rank's shards (parameters incl.
    compute-dtype copies, fp32 gradients, optimizer state) held on each tier.
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


class ZinfOutOfMemoryError(RuntimeError):
    """Materializing a parameter or gradient would exceed ``device_memory_budget``."""


def set_device_memory_budget(nbytes: Optional[int]) -> None:
    """Cap the bytes of materialized parameters and gradients on the compute device (None: no cap).

    On CPU this emulates a GPU's memory limit honestly: the runtime refuses, with an error naming
    the tensor and the bytes, instead of silently using more.
    """
    global _budget
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"device_memory_budget must be a positive int of bytes or None, got {nbytes!r}")
    _budget = nbytes


def device_memory_budget() -> Optional[int]:
    return _budget


def _over_budget(nbytes: int, what: str, kind: str) -> None:
    in_use = current("device", "gathered")
    raise ZinfOutOfMemoryError(
        f"zinf: out of device memory budget: {kind} {what} needs {nbytes} bytes while {in_use} bytes of "
        f"gathered parameters are live, over device_memory_budget={_budget}. Fix: raise "
        f"device_memory_budget, or let zinf tile this operator (options tiles=N or tile_threshold_bytes)."
    )


def materialize(nbytes: int, what: str) -> None:
    """Account ``nbytes`` of gathered parameter ``what``, refusing to go over the budget."""
    if _budget is not None and current("device", "gathered") + nbytes > _budget:
        _over_budget(nbytes, what, "materializing")
    add("device", "gathered", nbytes)
    add("device", "materialized", nbytes)


def released(nbytes: int) -> None:
    """A gathered parameter's ``nbytes`` were freed."""
    sub("device", "gathered", nbytes)
    sub("device", "materialized", nbytes)


@contextlib.contextmanager
def gradient_buffer(nbytes: int, what: str) -> Iterator[None]:
    """A full gradient of ``nbytes`` is live while it is reduced; it must fit beside the gathered
    parameters under the budget."""
    if _budget is not None and current("device", "gathered") + nbytes > _budget:
        _over_budget(nbytes, what, "the gradient of")
    add("device", "grad_buffer", nbytes)
    add("device", "materialized", nbytes)
    try:
        yield
    finally:
        sub("device", "grad_buffer", nbytes)
        sub("device", "materialized", nbytes)
