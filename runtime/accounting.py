"""Byte accounting per memory tier and kind, so memory claims can be checked.

Every runtime allocation of model state goes through an :class:`Accounting`'s ``add`` / ``sub`` (or
``set_bytes`` for totals recomputed in one go). Each compiled model owns one, inside its
``zinf_runtime.context.RuntimeContext``, together with its ``device_memory_budget``: the budget check
when a parameter is materialized looks at *that model's* gathered bytes and budget only, so two
models in one process never see each other's settings or usage::

    model A (budget 1 MiB) --ctx A--> Accounting A --+
    model B (no budget)    --ctx B--> Accounting B --+--> TOTAL (process-wide sum, current and peak)

Every per-model ``Accounting`` also reports into :data:`TOTAL`, so ``memory_stats()`` without a model
still answers, per tier (``device``, ``cpu``, ``nvme``) and kind (``param``, ``grad``, ``optim``,
``gathered``, ...), the process's current and *true* peak bytes (the peak of the sum, not a sum of
peaks), as ``torch.cuda.memory_stats`` does. The module-level :func:`add` / :func:`sub` /
:func:`set_bytes` record bytes no model owns (e.g. an optimizer's state) into :data:`TOTAL` only.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Iterator, Optional, Tuple

TIERS = ("device", "cpu", "nvme")
KINDS = ("param", "grad", "optim", "gathered", "grad_buffer", "comm", "materialized")

Stats = Dict[str, Dict[str, Dict[str, int]]]
_VALID = frozenset((t, k) for t in TIERS for k in KINDS)


def _check(tier: str, kind: str) -> None:
    if tier not in TIERS or kind not in KINDS:
        raise ValueError(f"unknown memory tier/kind {tier!r}/{kind!r}; tiers {TIERS}, kinds {KINDS}")


def check_budget(nbytes: Optional[int]) -> Optional[int]:
    """Validate a ``device_memory_budget`` value (positive int of bytes, or None for no cap)."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"device_memory_budget must be a positive int of bytes or None, got {nbytes!r}")
    return nbytes


class ZinfOutOfMemoryError(RuntimeError):
    """Materializing a parameter or gradient would exceed the model's ``device_memory_budget``."""


class Accounting:
    """Current and peak bytes per (tier, kind), and an optional budget on materialized bytes.

    ``parent`` (normally :data:`TOTAL`) receives every change too. Thread-safe.
    """

    def __init__(self, parent: Optional["Accounting"] = None, budget: Optional[int] = None, name: str = ""):
        self.parent = parent
        self.name = name
        self.budget = check_budget(budget)
        self._lock = threading.Lock()
        self._current: Dict[tuple[str, str], int] = {}
        self._peak: Dict[tuple[str, str], int] = {}
        _all.add(self)

    def add(self, tier: str, kind: str, nbytes: int) -> None:
        """Record ``nbytes`` more bytes of ``kind`` resident on ``tier``."""
        self.add_kinds(tier, (kind,), nbytes)

    def add_kinds(self, tier: str, kinds: Tuple[str, ...], nbytes: int) -> None:
        """Record ``nbytes`` more bytes under each of ``kinds`` on ``tier``, in this accounting and
        its parents, one lock per level. Why one call: the runtime books several kinds per event (a
        gradient buffer is ``grad_buffer`` and ``materialized``) on every parameter of every step,
        and per-kind calls with their checks were about 1,500 Python calls per step of a 25M GPT."""
        nbytes = int(nbytes)
        for kind in kinds:
            if (tier, kind) not in _VALID:
                _check(tier, kind)
        acc: Optional[Accounting] = self
        while acc is not None:
            with acc._lock:
                current, peak = acc._current, acc._peak
                for kind in kinds:
                    key = (tier, kind)
                    cur = current.get(key, 0) + nbytes
                    current[key] = cur
                    if cur > peak.get(key, 0):
                        peak[key] = cur
            acc = acc.parent

    def sub(self, tier: str, kind: str, nbytes: int) -> None:
        """Record that ``nbytes`` bytes of ``kind`` left ``tier``."""
        self.add(tier, kind, -int(nbytes))

    def set_bytes(self, tier: str, kind: str, nbytes: int) -> None:
        """Set the current bytes of ``kind`` on ``tier`` (the parent gets the difference)."""
        _check(tier, kind)
        with self._lock:
            key = (tier, kind)
            delta = int(nbytes) - self._current.get(key, 0)
            self._current[key] = int(nbytes)
            if nbytes > self._peak.get(key, 0):
                self._peak[key] = int(nbytes)
        if self.parent is not None and delta:
            self.parent.add(tier, kind, delta)

    def current(self, tier: str, kind: str) -> int:
        _check(tier, kind)
        return self._current.get((tier, kind), 0)

    def stats(self) -> Stats:
        """``stats[tier][kind] == {"current": int, "peak": int}``; see :func:`memory_stats`."""
        with self._lock:
            return {
                tier: {
                    kind: {"current": self._current.get((tier, kind), 0), "peak": self._peak.get((tier, kind), 0)}
                    for kind in KINDS
                }
                for tier in TIERS
            }

    def reset_peak(self) -> None:
        with self._lock:
            for key in list(self._peak):
                self._peak[key] = self._current.get(key, 0)

    # -- the device memory budget ------------------------------------------------------------------
    def _over_budget(self, nbytes: int, what: str, kind: str) -> None:
        in_use = self.current("device", "gathered")
        owner = f" of {self.name}" if self.name else ""
        raise ZinfOutOfMemoryError(
            f"zinf: out of device memory budget{owner}: {kind} {what} needs {nbytes} bytes while {in_use} bytes "
            f"of gathered parameters are live, over device_memory_budget={self.budget}. Fix: raise "
            f"device_memory_budget, or let zinf tile this operator (options tiles=N or tile_threshold_bytes)."
        )

    def materialize(self, nbytes: int, what: str) -> None:
        """Account ``nbytes`` of gathered parameter ``what``, refusing to go over the budget."""
        if self.budget is not None and self.current("device", "gathered") + nbytes > self.budget:
            self._over_budget(nbytes, what, "materializing")
        self.add_kinds("device", _GATHERED, nbytes)

    def released(self, nbytes: int) -> None:
        """A gathered parameter's ``nbytes`` were freed."""
        self.add_kinds("device", _GATHERED, -nbytes)

    @contextlib.contextmanager
    def gradient_buffer(self, nbytes: int, what: str) -> Iterator[None]:
        """A full gradient of ``nbytes`` is live while it is reduced; it must fit beside the gathered
        parameters under the budget."""
        self.gradient_buffer_start(nbytes, what)
        try:
            yield
        finally:
            self.gradient_buffer_end(nbytes)

    def gradient_buffer_start(self, nbytes: int, what: str) -> None:
        """``gradient_buffer``'s entry, for the per-gradient hot path (no generator per call); pair
        it with ``gradient_buffer_end`` in a ``finally``."""
        if self.budget is not None and self.current("device", "gathered") + nbytes > self.budget:
            self._over_budget(nbytes, what, "the gradient of")
        self.add_kinds("device", _GRAD_BUFFER, nbytes)

    def gradient_buffer_end(self, nbytes: int) -> None:
        self.add_kinds("device", _GRAD_BUFFER, -nbytes)

    def comm_buffers(self, owner: object, nbytes: int) -> weakref.finalize:
        """A coalesced collective's flat buffers (``zinf_runtime.bucket``: the packed input and the
        collective's output) hold ``nbytes`` on the device until the returned finalizer is called (it
        runs once), or else until ``owner`` (the output) is freed. Not budget-checked: a bucket
        only coalesces parameters under ``bucket_bytes``, and refusing one mid-graph would leave its
        members' waits without a collective."""
        self.add_kinds("device", _COMM, nbytes)
        return weakref.finalize(owner, self.add_kinds, "device", _COMM, -int(nbytes))


_GATHERED = ("gathered", "materialized")
_GRAD_BUFFER = ("grad_buffer", "materialized")
_COMM = ("comm", "materialized")
_all: "weakref.WeakSet[Accounting]" = weakref.WeakSet()

#: The process-wide view: every model's bytes plus bytes no model owns. It has no budget.
TOTAL = Accounting(name="the process")


def add(tier: str, kind: str, nbytes: int) -> None:
    """Record ``nbytes`` bytes no model owns (an optimizer's state) in the process-wide view."""
    TOTAL.add(tier, kind, nbytes)


def sub(tier: str, kind: str, nbytes: int) -> None:
    TOTAL.sub(tier, kind, nbytes)


def set_bytes(tier: str, kind: str, nbytes: int) -> None:
    TOTAL.set_bytes(tier, kind, nbytes)


def current(tier: str, kind: str) -> int:
    """Process-wide current bytes of ``kind`` on ``tier``."""
    return TOTAL.current(tier, kind)


def reset_peak_memory_stats() -> None:
    """Set every peak, process-wide and per model, to the current value (like
    ``torch.cuda.reset_peak_memory_stats``)."""
    for acc in list(_all):
        acc.reset_peak()


def sum_stats(parts: "list[Stats]") -> Stats:
    """Element-wise sum of several ``stats()`` results (peaks summed: an upper bound of the peak)."""
    out = {tier: {kind: {"current": 0, "peak": 0} for kind in KINDS} for tier in TIERS}
    for s in parts:
        for tier in TIERS:
            for kind in KINDS:
                for k in ("current", "peak"):
                    out[tier][kind][k] += s[tier][kind][k]
    return out


def set_device_memory_budget(nbytes: Optional[int]) -> None:
    """Set the budget of the *default* runtime context only: the one used by parameters partitioned
    directly through ``zinf_runtime.partition`` with a ``Placement`` that names no context.

    Compiled models take their budget from their own ``device_memory_budget`` option; this never
    changes them (it used to be process-wide, which let one model's setting leak into another's).
    """
    from .context import DEFAULT

    DEFAULT.device_memory_budget = nbytes


def device_memory_budget() -> Optional[int]:
    """The default context's budget (see :func:`set_device_memory_budget`)."""
    from .context import DEFAULT

    return DEFAULT.device_memory_budget
