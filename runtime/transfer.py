"""The transfer engine: every parameter and gradient transfer as a start returning a ticket, and a wait.

One engine per model (``RuntimeContext.transfers``). The graph ops of ``zinf_runtime.ops`` start a
transfer at the point the schedule chose and wait for it right before its first use::

    serial (before):  shard = fetch_shard(p)           # NVMe read + copy, blocking
                      full  = all_gather(shard)        # blocking collective
    scheduled (after): t1 = load(p)                    # op i-3: NVMe -> host, swap engine threads
                      t2 = upload(p, [t1])             # op i-2: host -> device, a lane thread / side stream
                      s  = wait_upload(t2)             # op i-1, before its first use:
                      t3 = gather(s)                   #        the all-gather, async_op=True
                      w  = wait_gather(t3)             # op i:   the full parameter
    backward:         t4 = reduce(g, p)                # reduce-scatter, async_op=True
                      t5 = wait_reduce(t4)             # op j+1: shard final, offload starts
                      wait_offload(t5)                 # op j+2: accumulated on the optimizer tier

A ticket is an int64 CPU tensor of one element (a graph value the compiler can order and pass,
never read on a device); the engine maps its id to the pending work. Links and what runs them:

    nvme_read, nvme_write  the swap engine's IO threads (``zinf_runtime.swap``)
    h2d                    a lane thread on CPU; on CUDA a side stream, ordered by events
    all_gather, reduce_scatter   torch.distributed with ``async_op=True``, always issued from the
                           main thread in graph order, so every rank issues the same sequence
    d2h                    (gradient offload) a lane thread on CPU; on CUDA the current stream (the
                           fused copy kernels are already asynchronous to the host)

Buffer safety: a ticket holds every tensor its transfer reads or writes until its wait returns;
the wait orders the caller after the transfer (thread join, ``Work.wait()``, or
``current_stream.wait_event`` + ``record_stream``), so a buffer is freed or reused only after every
transfer reading it is done. Pooled NVMe buffers go back to the pool after the upload that reads
them (with a fence on CUDA). Lanes are FIFO: gradient offloads of one parameter apply in order.

``abandon()`` (a graph raised between a start and its wait) waits for whatever is in flight and
drops it, so nothing runs on after the error. With ``trace`` set, every transfer and graph run is
timed for ``zinf_runtime.trace``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import trace as _trace

#: every pending ticket by id. Process-wide on purpose: Dynamo runs one compiled graph for every
#: instance of a model class, so a wait may resolve a different model's handle than its start; the
#: engine that started a ticket (its lanes, trace, counters) is the one it belongs to.
_PENDING: Dict[int, "Ticket"] = {}


class _TicketTensors:
    """Ticket tensors, made ``BLOCK`` at a time in one tight loop: each a one-element int64 CPU tensor
    of its own holding its id.

    Why: a start made its ticket with ``torch.tensor([id])`` and its wait read it back with
    ``int(t.reshape(-1)[0])``: four small aten calls per transfer, about 3.5 us each alone, but
    about 33 us each inside a step, where every call between two large kernels runs from cold
    caches. The 25M GPT at dp 2 makes 644 tickets a step: 47 ms of a 1.3 s step went to making and
    reading them (timed per call). Made in a loop, a ticket costs about 1.5 us, and a wait reads its
    ticket with ``item()``.

    Each ticket has its own storage (a custom op's outputs must not alias each other or its inputs:
    views of one block made ``zinf.gather_bucket``'s tickets fail torch's check) and is handed out
    once (ids only grow), so a compiler that reuses a dead ticket's memory (Inductor may, for a
    fallback op's result) writes into memory no later ticket reads."""

    BLOCK = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1  # the id of the next block's first ticket
        self._block: List[torch.Tensor] = []
        self._base = 0
        self._i = 0

    def take(self) -> Tuple[int, torch.Tensor]:
        """A fresh ticket: ``(id, one-element int64 CPU tensor holding id)``."""
        with self._lock:
            if self._i == len(self._block):
                self._base, self._next = self._next, self._next + self.BLOCK
                self._block = [torch.full((1,), i, dtype=torch.int64) for i in range(self._base, self._next)]
                self._i = 0
            i = self._i
            self._i += 1
            token, self._block[i] = self._block[i], None  # type: ignore[call-overload]
            return self._base + i, token


_TICKETS = _TicketTensors()

#: bytes below which a host copy runs inline: a thread hand-off costs more than copying them
INLINE_COPY_BYTES = 256 << 10


class Lane:
    """One FIFO worker thread for one link. ``submit`` returns a future-like :class:`Job`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._q: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.submitted = 0  # jobs handed to the thread (tests: which copies ran inline)

    def submit(self, fn: Callable[[], Any]) -> "Job":
        job = Job(fn)
        with self._lock:
            self.submitted += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"zinf-{self.name}", daemon=True)
                self._thread.start()
        self._q.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job.run()

    def close(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._q.put(None)
                self._thread.join(timeout=30)
            self._thread = None


class Job:
    """A function run by a lane; ``wait()`` returns its result or raises its exception."""

    __slots__ = ("fn", "done", "result", "error", "t0", "t1")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.t0 = self.t1 = 0.0

    def run(self) -> None:
        self.t0 = time.perf_counter()
        try:
            self.result = self.fn()
        except BaseException as e:  # re-raised on the waiting thread
            self.error = e
        self.t1 = time.perf_counter()
        self.fn = None
        self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Ticket:
    """One pending transfer: what to wait on, what to keep alive until then, what to return."""

    __slots__ = ("id", "link", "label", "nbytes", "wait_fn", "keep", "t0", "job", "engine", "poll")

    def __init__(self, link: str, label: str, nbytes: int, wait_fn: Callable[[], Any], keep: Tuple = (),
                 job: Optional[Job] = None, poll: Optional[Callable[[], bool]] = None) -> None:
        self.id = 0
        self.link = link
        self.label = label
        self.nbytes = nbytes
        self.wait_fn = wait_fn
        self.poll = poll or _never  # True once waiting would not block (False: unknown, or not yet)
        self.keep = keep  # tensors the transfer reads or writes: alive until its wait returns
        self.t0 = time.perf_counter()
        self.job = job
        self.engine: Optional["TransferEngine"] = None


class TransferEngine:
    """The pending transfers of one model; see the module docstring."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._mine: Dict[int, Ticket] = {}
        self._lanes: Dict[str, Lane] = {}
        self._streams: Dict[torch.device, Any] = {}
        self.tracer: Optional[_trace.Tracer] = None
        self.counters: Dict[str, int] = {}
        self._last_exit = 0.0

    # -- tickets ---------------------------------------------------------------------------------
    def start(self, ticket: Ticket) -> torch.Tensor:
        """Register a started transfer; the ticket tensor the graph passes to its wait."""
        ticket.id, token = _TICKETS.take()
        ticket.engine = self
        _PENDING[ticket.id] = ticket
        self._mine[ticket.id] = ticket
        self.counters[ticket.link] = self.counters.get(ticket.link, 0) + 1
        return token

    def done(self, link: str, label: str, result: Any = None) -> torch.Tensor:
        """A ticket for work that already finished (nothing to overlap)."""
        return self.start(Ticket(link, label, 0, lambda: result, poll=_always))

    def enter(self) -> None:
        """A zinf op starts on the main thread: the time since the previous one was compute."""
        if self.tracer is not None:
            now = time.perf_counter()
            if self._last_exit and now - self._last_exit > 20e-6:
                self.tracer.span("compute", "compute", self._last_exit, now)

    def leave(self) -> None:
        if self.tracer is not None:
            self._last_exit = time.perf_counter()

    def trace_span(self, lane: str, name: str, t0: float, t1: float, **args: Any) -> None:
        if self.tracer is not None:
            self.tracer.span(lane, name, t0, t1, **args)

    @property
    def in_flight(self) -> int:
        return len(self._mine)

    def abandon(self) -> None:
        """Wait for and drop every pending transfer (a graph raised between start and wait)."""
        mine, self._mine = self._mine, {}
        for tid, ticket in mine.items():
            _PENDING.pop(tid, None)
            try:
                ticket.wait_fn()
            except Exception:
                pass

    # -- links -----------------------------------------------------------------------------------
    def lane(self, name: str) -> Lane:
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = Lane(f"{self.name}-{name}" if self.name else name)
        return lane

    def side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def close(self) -> None:
        self.abandon()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        if self.tracer is not None:
            self.tracer.flush()


def take(token: torch.Tensor, link: str) -> Ticket:
    """The pending ticket of ``token``, removed from the registry (each is waited once)."""
    tid = int(token.item())
    ticket = _PENDING.pop(tid, None)
    if ticket is None:
        raise RuntimeError(f"zinf: transfer ticket {tid} ({link}) is unknown or already waited for; "
                           "a start op ran twice or its graph was re-entered")
    if ticket.engine is not None:
        ticket.engine._mine.pop(tid, None)
    if ticket.link != link:
        raise RuntimeError(f"zinf: ticket {tid} is a {ticket.link} transfer, waited for as {link}")
    return ticket


def finish(ticket: Ticket) -> Any:
    """Wait for ``ticket``'s transfer; its result. Traced: the transfer's own span (a lane job's
    run, else start to completion as seen here) and the time this thread blocked."""
    t0 = time.perf_counter()
    result = ticket.wait_fn()
    eng = ticket.engine
    if eng is not None and eng.tracer is not None:
        t1 = time.perf_counter()
        job = ticket.job
        a, b = (job.t0, job.t1) if job is not None else (ticket.t0, t1)
        eng.tracer.span(ticket.link, ticket.label, a, b, nbytes=ticket.nbytes)
        if t1 - t0 > 20e-6:
            eng.tracer.span("wait", f"wait {ticket.link} {ticket.label}", t0, t1)
    ticket.keep = ()
    return result


def wait(token: torch.Tensor, link: str) -> Any:
    ticket = take(token, link)
    eng = ticket.engine
    if eng is not None:
        eng.enter()
    try:
        return finish(ticket)
    finally:
        if eng is not None:
            eng.leave()


# -- the op implementations (registered in zinf_runtime.ops) ------------------------------------------
def _nb(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def op_load(param: torch.Tensor, uid: int) -> torch.Tensor:
    from . import store

    h = store.resolve(param, uid)
    eng = h.context.transfers
    eng.enter()
    carried = None
    if "_carry" in eng.__dict__:  # a read the previous graph's end started for this one (runtime/carry.py)
        from .carry import carry_of

        carried = carry_of(eng).take(h)
    host, read = carried if carried is not None else h.load_host()
    if read is None:  # a memory tier (None), or the shard from the read cache (nothing to wait for)
        tok = eng.done("nvme_read", h.name, host)
    else:
        tok = eng.start(_read_ticket(h, host, read))
    eng.leave()
    return tok


def _always() -> bool:
    return True


def _never() -> bool:
    return False


def _read_ticket(h: Any, host: torch.Tensor, read: Any) -> Ticket:
    return Ticket("nvme_read", h.name, _nb(host), lambda: (read.wait(), host)[1], keep=(host,), poll=read.done)


def op_upload(param: torch.Tensor, uid: int, shard_numel: int, dtype: torch.dtype,
              loaded: Optional[torch.Tensor]) -> torch.Tensor:
    from . import store

    h = store.resolve(param, uid)
    eng = h.context.transfers
    eng.enter()
    try:
        return _upload(h, eng, dtype, loaded)
    finally:
        eng.leave()


def _upload(h: Any, eng: TransferEngine, dtype: torch.dtype, loaded: Optional[torch.Tensor]) -> torch.Tensor:
    load = take(loaded, "nvme_read") if loaded is not None else None
    if load is None:
        host, read = h.load_host()
        if read is not None:  # an NVMe shard the schedule gave no read of its own: read it now
            load = _read_ticket(h, host, read)
            load.engine = eng
        elif host is not None:  # ... found in the read cache
            load = Ticket("nvme_read", h.name, 0, lambda: host, poll=_always)
    if load is None:
        alias = h.shard_in_place(dtype)
        if alias is not None:  # nothing to move: the slot is read where it is
            return eng.done("h2d", h.name, alias)
    out = h.new_shard(dtype)
    nbytes = _nb(out)
    if out.is_cuda:
        # the read must be done before the copy is enqueued; the copy itself runs on a side stream
        host = finish(load) if load is not None else None
        cur = torch.cuda.current_stream(out.device)
        side = eng.side_stream(out.device)
        side.wait_stream(cur)  # ``out`` was allocated on the current stream: its memory may be in use there
        pooled: List[Tuple[torch.Tensor, Any]] = []  # the NVMe read buffer, returned at the wait
        with torch.cuda.stream(side):
            h.upload(dtype, host, out=out, give_back=lambda buf, fence: pooled.append((buf, fence)))
            out.record_stream(side)  # freed on the current stream: the allocator waits for the copy too
            ev = torch.cuda.Event()
            ev.record(side)

        def ready() -> torch.Tensor:
            c = torch.cuda.current_stream(out.device)
            c.wait_event(ev)
            out.record_stream(c)
            for buf, fence in pooled:  # the fence waits for the copy reading it before it is reused
                h.keep_read(buf, fence)
            return out

        return eng.start(Ticket("h2d", h.name, nbytes, ready, keep=(out,)))

    def copy() -> torch.Tensor:
        host = finish(load) if load is not None else None
        return h.upload(dtype, host, out=out)

    # inline when nothing is left to wait for: a small memory-tier copy, or a shard whose read is done
    # (a read cache hit, a prefetched read that finished). On the CPU the copy is the same work on either
    # thread, and the compute's intra-op threads already use every core: a lane only adds two wake-ups
    # (measured: forward + backward of the 25M dp-2 NVMe step 2-6% faster in 5 of 6 pairs, README). The lane
    # is for a copy that must wait for a read.
    if (load is None and nbytes < INLINE_COPY_BYTES) or (load is not None and load.poll()):
        return eng.done("h2d", h.name, copy())
    job = eng.lane("h2d").submit(copy)
    return eng.start(Ticket("h2d", h.name, nbytes, job.wait, keep=(out,), job=job))


def op_wait_upload(ticket: torch.Tensor, param: torch.Tensor, uid: int, shard_numel: int,
                   dtype: torch.dtype) -> torch.Tensor:
    return wait(ticket, "h2d")


def op_gather(shard: torch.Tensor, uid: int, shape: List[int]) -> torch.Tensor:
    from . import store

    h = store.get(uid)
    if h.world == 1:
        raise RuntimeError(f"zinf.gather on {h.name!r}: dp = 1 graphs view the fetched shard instead")
    eng = h.context.transfers
    eng.enter()
    shard = h.collective_input(shard)  # kept by the ticket below until the collective is done
    buf, work = h.start_all_gather(shard)
    tok = eng.start(Ticket("all_gather", h.name, _nb(buf), lambda: (work.wait(), buf)[1], keep=(shard, buf)))
    eng.leave()
    return tok


def op_wait_gather(ticket: torch.Tensor, shard: torch.Tensor, uid: int, shape: List[int]) -> torch.Tensor:
    from . import store

    return store.get(uid).gathered_view(wait(ticket, "all_gather"))


def op_reduce(grad: torch.Tensor, param: torch.Tensor, uid: int) -> torch.Tensor:
    from . import store

    h = store.resolve(param, uid)
    eng = h.context.transfers
    eng.enter()
    try:
        if h.tiles is not None:  # tiled by another compile, reduced whole here: tile by tile, now
            h.reduce_grad(grad)
            return eng.done("reduce_scatter", h.name)
        h._begin_grad()
        buffer = h.context.accounting.gradient_buffer(_nb(grad), h.name)
        buffer.__enter__()  # the full gradient is live until its shard is offloaded
        shard, pending = h.start_reduce(grad)
        owned = not store.shares_storage(shard, grad)  # dp > 1 or a cast: the slot may keep it

        def reduced() -> Tuple[Any, torch.Tensor, Any, bool]:
            return h, h.finish_reduce(shard, pending), buffer, owned

        return eng.start(Ticket("reduce_scatter", h.name, _nb(grad), reduced, keep=(grad, shard, pending)))
    finally:
        eng.leave()


def op_wait_reduce(ticket: torch.Tensor, grad: torch.Tensor, param: torch.Tensor, uid: int) -> torch.Tensor:
    t = take(ticket, "reduce_scatter")
    eng = t.engine
    eng.enter()
    try:
        return _offload(eng, t, finish(t))
    finally:
        eng.leave()


def _offload(eng: TransferEngine, t: Ticket, result: Any) -> torch.Tensor:
    if result is None:  # reduced synchronously
        return eng.done("d2h", t.label)
    h, shard, buffer, owned = result

    def offload() -> None:
        h.accumulate_grad(shard, owned=owned)

    if shard.is_cuda or _nb(shard) < INLINE_COPY_BYTES:  # CUDA: the copy kernels are async already
        try:
            offload()
        finally:
            buffer.__exit__(None, None, None)
        return eng.done("d2h", h.name)
    job = eng.lane("d2h").submit(offload)

    def offloaded() -> None:
        try:
            job.wait()
        finally:
            buffer.__exit__(None, None, None)

    return eng.start(Ticket("d2h", h.name, _nb(shard), offloaded, keep=(shard,), job=job))


def op_wait_offload(ticket: torch.Tensor, grad: torch.Tensor, uid: int) -> None:
    wait(ticket, "d2h")


def optimizer_step_done(optimizer: Any, t0: float) -> None:
    """An optimizer step over partitioned parameters ran from ``t0`` to now: trace it, and end the
    traced step of every model it stepped (a no-op without ``trace``)."""
    from . import store

    engines = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            h = store.handle_of(p)
            if h is not None and h.context.transfers.tracer is not None and h.context.transfers not in engines:
                engines.append(h.context.transfers)
    t1 = time.perf_counter()
    for eng in engines:
        eng.tracer.span("optimizer", type(optimizer).__name__, t0, t1)
        eng.tracer.step_done()
        eng._last_exit = 0.0  # the time until the next zinf op is the loop's, not the graph's compute
