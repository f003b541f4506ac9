"""Per-model runtime state: the device memory budget, the accounting, swap engines, host buffers.

Nothing a model is configured with lives in the process: each compiled model owns one
:class:`RuntimeContext`, referenced by every ``ParamHandle`` (through its ``Placement``) and every
``tiers.Slot`` of that model, so two models in one process keep their own budgets, byte counts,
NVMe folders and buffer pools::

    torch.compile(a, backend="zinf", options=opts_a)  ->  RuntimeContext A (budget, accounting,
    torch.compile(b, backend="zinf", options=opts_b)  ->  RuntimeContext B  engines, pool, writes)

Which context a parameter joins, when ``partition`` is given a ``Placement`` that names none:

1. the context of parameters of the same call that are already partitioned (a graph sharing
   parameters with an earlier graph of the model, or a recompile);
2. else the context of the ``torch.compile`` call being compiled: the backend wraps each graph's
   compile in :func:`compiling`, keyed by the ``options`` object Dynamo hands it, which is the same
   object for every graph of one ``torch.compile`` call (graph breaks included) and a different
   one for another call. Without options Dynamo passes none: then each graph gets its own context
   (their budget is None; graphs run one after another and free what they gather, so budget
   verdicts per graph equal those per model);
3. else (direct runtime use, outside any compile) the process's :data:`DEFAULT` context.

So give each model its own options dict (a fresh ``{...}`` per ``torch.compile`` call): models
compiled with one shared options object share one context (the same budget value, but one
accounting, one swap folder), and so does a model whose parameters are served by another instance's
compiled graph (Dynamo reuses one graph for instances of a class compiled with the same options).

Lifetime: the context lives as long as a handle or slot refers to it. When the model is deleted,
its parameters' finalizers free their handles; the context then closes its swap engines (their
folders are removed) and drops its pooled buffers. Swap engines also close at interpreter exit.
"""

from __future__ import annotations

import contextlib
import functools
import contextvars
import itertools
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import accounting, tiers
from .read_cache import ReadCache
from .transfer import TransferEngine
from .swap import SwapConfig, SwapEngine

_ids = itertools.count()


def _close_engines(engines: Dict[Tuple[SwapConfig, int], SwapEngine]) -> None:
    for eng in list(engines.values()):
        try:
            eng.close()
        except Exception:  # a finalizer must not raise; the folder goes with the engine's own finalizer
            pass
    engines.clear()


class RuntimeContext:
    """The runtime state one compiled model owns; see the module docstring."""

    def __init__(self, device_memory_budget: Optional[int] = None, name: str = "",
                 pool: Optional[tiers.BufferPool] = None, writes: Optional[tiers.WriteTracker] = None):
        self.id = next(_ids)
        self.name = name or f"model context {self.id}"
        self.accounting = accounting.Accounting(accounting.TOTAL, device_memory_budget, self.name)
        self.pool = pool if pool is not None else tiers.BufferPool()
        self.writes = writes if writes is not None else tiers.WriteTracker()
        self.dirty = tiers.DirtyTracker()  # NVMe values kept in memory unwritten (gradients; Slot.set defer)
        # NVMe parameter values the optimizer set, kept unwritten (write-back; capped by nvme_read_cache_bytes)
        self.kept = tiers.DirtyTracker(cap_bytes=64 << 20)
        self.read_cache = ReadCache(self.pool)  # clean NVMe reads kept for the next reader (runtime/read_cache.py)
        self._engines: Dict[Tuple[SwapConfig, int], SwapEngine] = {}
        self._lock = threading.Lock()
        self._keys: List[Any] = []  # compile keys resolved to this context, kept so their ids stay unique
        self.transfers = TransferEngine(f"ctx{self.id}")  # this model's pending transfers and lanes
        self._finalizer = weakref.finalize(self, _close_engines, self._engines)

    @property
    def device_memory_budget(self) -> Optional[int]:
        """Bytes of materialized parameters + gradients allowed on the compute device (None: no cap)."""
        return self.accounting.budget

    @device_memory_budget.setter
    def device_memory_budget(self, nbytes: Optional[int]) -> None:
        self.accounting.budget = accounting.check_budget(nbytes)

    def engine(self, cfg: SwapConfig, rank: int) -> SwapEngine:
        """This context's swap engine for these settings and rank (created on first use)."""
        with self._lock:
            eng = self._engines.get((cfg, rank))
            if eng is None:
                eng = SwapEngine(cfg, rank)
                # the transfer engine, not self: the engine must not keep its context alive
                eng.observer = functools.partial(_trace_write, self.transfers)
                self._engines[(cfg, rank)] = eng
                tiers._engines[(self.id, cfg, rank)] = eng
            return eng

    def engines(self) -> List[SwapEngine]:
        with self._lock:
            return list(self._engines.values())

    def memory_stats(self) -> accounting.Stats:
        return self.accounting.stats()

    def close(self) -> None:
        """Close the swap engines (their folders are removed) and drop pooled buffers. Slots of this
        context must not be used afterwards."""
        self.transfers.close()
        self._finalizer()
        self.read_cache.clear()
        self.pool.clear()

    def __repr__(self) -> str:
        return f"RuntimeContext({self.name!r}, device_memory_budget={self.device_memory_budget})"


#: For parameters partitioned outside any compile with a Placement naming no context.
DEFAULT = RuntimeContext(name="default context", pool=tiers.pool, writes=tiers._default_writes)


# -- the compile being run: which context new parameters join -----------------------------------------
class _Compile:
    def __init__(self, key: Any, budget: Optional[int]):
        self.key, self.budget = key, budget


_active: "contextvars.ContextVar[Optional[_Compile]]" = contextvars.ContextVar("zinf_compile", default=None)
_by_key: "weakref.WeakValueDictionary[int, RuntimeContext]" = weakref.WeakValueDictionary()
_by_key_lock = threading.Lock()


@contextlib.contextmanager
def compiling(key: Any, *, device_memory_budget: Optional[int] = None,
              malloc_mmap_threshold: Optional[int] = None) -> Iterator[None]:
    """Partitions in this block belong to the compile identified by ``key`` (the options object of
    one ``torch.compile`` call; None: no identity, a fresh context per partition call).

    ``device_memory_budget`` becomes the budget of the context its parameters join;
    ``malloc_mmap_threshold`` (None: leave glibc alone) is applied now, see
    ``tiers.set_malloc_mmap_threshold`` for why it is an option.
    """
    accounting.check_budget(device_memory_budget)
    if malloc_mmap_threshold is not None:
        tiers.set_malloc_mmap_threshold(malloc_mmap_threshold)
    token = _active.set(_Compile(key, device_memory_budget))
    try:
        yield
    finally:
        _active.reset(token)


def resolve_context(existing: Optional[RuntimeContext]) -> RuntimeContext:
    """The context for new parameters of a ``partition`` call (rules 1-3 of the module docstring);
    ``existing`` is the context of the call's already-partitioned parameters, if any."""
    comp = _active.get()
    if comp is None:
        return existing if existing is not None else DEFAULT
    ctx = existing
    with _by_key_lock:
        if comp.key is not None:
            if ctx is None:
                ctx = _by_key.get(id(comp.key))
            if ctx is not None and _by_key.get(id(comp.key)) is not ctx:
                _by_key[id(comp.key)] = ctx
                ctx._keys.append(comp.key)
        if ctx is None:
            ctx = RuntimeContext()
            if comp.key is not None:
                _by_key[id(comp.key)] = ctx
                ctx._keys.append(comp.key)
    if ctx is not DEFAULT:
        ctx.device_memory_budget = comp.budget  # the latest compile of a model sets its budget
    return ctx


# -- per-model views ------------------------------------------------------------------------------------
def contexts_of(model: Any) -> List[RuntimeContext]:
    """The contexts holding ``model``'s partitioned parameters (a module, an iterable of
    parameters, or a RuntimeContext), in first-seen order."""
    from . import store

    if isinstance(model, RuntimeContext):
        return [model]
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    out: List[RuntimeContext] = []
    for p in params:
        h = store.handle_of(p)
        if h is not None and h.context not in out:
            out.append(h.context)
    return out


def memory_stats(model: Any = None) -> accounting.Stats:
    """Current and peak bytes: ``stats[tier][kind] == {"current": int, "peak": int}``.

    Without ``model``: the whole process (every model, plus bytes no model owns such as optimizer
    state), with the true peak of the sum. With ``model`` (a module, its parameters, or a
    ``RuntimeContext``): that model's own bytes only. A model whose graphs were compiled by several
    ``torch.compile`` calls spans several contexts: their figures are summed (peaks then are an
    upper bound).

    ``gathered`` is the bytes of full (all-gathered) parameters materialized on the compute device;
    ``grad_buffer`` the full gradients handed to ``reduce_grad`` (live until reduced);
    ``comm`` the flat buffers zinf allocates for coalesced collectives (``bucket_bytes``: packed input
    and output, live from the bucket's start to its last member's wait; a collective backend's own
    staging, such as gloo's copies, is not zinf's and not booked); ``materialized`` the sum of the three,
    the parameter + gradient working memory the paper's tiling bounds.
    ``param``, ``grad`` and ``optim`` are the bytes of this rank's shards (parameters incl.
    compute-dtype copies, fp32 gradients, NVMe optimizer state) held on each tier; the state of a
    memory-tier optimizer is counted process-wide only.
    """
    if model is None:
        return accounting.TOTAL.stats()
    ctxs = contexts_of(model)
    if len(ctxs) == 1:
        return ctxs[0].accounting.stats()
    return accounting.sum_stats([c.accounting.stats() for c in ctxs])


_NVME_FIELDS = ("bytes_read", "bytes_written", "reads", "writes", "disk_bytes", "peak_disk_bytes", "busy_s")


def io_stats(model: Any) -> Dict[str, Dict[str, float]]:
    """``model``'s NVMe traffic since it was partitioned, and what its host-memory caches saved.

    Why: ``memory_stats`` says where bytes live, not how often they moved. A user tuning
    ``nvme_read_cache_bytes`` or ``optimizer_sub_group_bytes`` needs the disk's side: how many
    bytes the swap engines read and wrote, and how many reads the read cache served instead::

        io_stats(model) == {
            "nvme":       {"bytes_read", "bytes_written", "reads", "writes",          # payload, requests
                           "disk_bytes", "peak_disk_bytes", "busy_s"},               # files; seconds with IO in flight
            "read_cache": {"hits", "kept", "bytes", "peak_bytes", "cap_bytes"},      # zinf_runtime.read_cache
            "write_back": {"written_back", "bytes", "peak_bytes", "cap_bytes"},     # gradients held unwritten
            "kept_params": {"written_back", "bytes", "peak_bytes", "cap_bytes"}}    # stepped parameters held unwritten

    ``hits`` counts reads served from memory (no IO); ``kept`` the buffers handed in and kept (after
    a fetch, or a parameter's written master); ``written_back`` the deferred gradients, or the
    stepped parameters (``nvme_param_write_back``), that had to go to disk after all. Summed over the model's contexts; the engines' counters are payload bytes,
    which ``/proc/self/io`` confirms in ``benchmarks/compare.py``'s disk column."""
    ctxs = contexts_of(model)
    if not ctxs:
        raise ValueError("zinf io_stats: the model has no partitioned parameters; pass the module (or its "
                         "parameters) that torch.compile(..., backend='zinf') trained, after its first call")
    nvme: Dict[str, float] = dict.fromkeys(_NVME_FIELDS, 0)
    cache: Dict[str, float] = dict.fromkeys(("hits", "kept", "bytes", "peak_bytes", "cap_bytes"), 0)
    back: Dict[str, float] = dict.fromkeys(("written_back", "bytes", "peak_bytes", "cap_bytes"), 0)
    kept: Dict[str, float] = dict.fromkeys(("written_back", "bytes", "peak_bytes", "cap_bytes"), 0)
    for ctx in ctxs:
        for eng in ctx.engines():
            st = eng.stats()
            for k in _NVME_FIELDS:
                nvme[k] += st[k]
        rc, d = ctx.read_cache, ctx.dirty
        for k, v in (("hits", rc.hits), ("kept", rc.kept), ("bytes", rc.bytes), ("peak_bytes", rc.peak_bytes),
                     ("cap_bytes", rc.cap_bytes)):
            cache[k] += v
        for k, v in (("written_back", d.written_back), ("bytes", d.bytes), ("peak_bytes", d.peak_bytes),
                     ("cap_bytes", d.cap_bytes)):
            back[k] += v
        kp = ctx.kept
        for k, v in (("written_back", kp.written_back), ("bytes", kp.bytes), ("peak_bytes", kp.peak_bytes),
                     ("cap_bytes", kp.cap_bytes)):
            kept[k] += v
    return {"nvme": nvme, "read_cache": cache, "write_back": back, "kept_params": kept}


def reset_peak_memory_stats(model: Any = None) -> None:
    """Set peaks to current values: every peak (process-wide and per model), or ``model``'s only."""
    if model is None:
        accounting.reset_peak_memory_stats()
        return
    for c in contexts_of(model):
        c.accounting.reset_peak()


def _trace_write(transfers: TransferEngine, h: Any) -> None:
    """A finished swap write, as a span of the step trace's ``nvme_write`` lane (reads are traced
    where they are waited for: a fetch's by its transfer ticket, the optimizer's by
    ``optim._wait_reads``)."""
    if h.kind == "write" and transfers.tracer is not None:
        transfers.trace_span("nvme_write", h.key, h.t_start, h.t_done, nbytes=h.nbytes)
