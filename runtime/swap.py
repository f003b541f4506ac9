"""NVMe swap engine: the slowest tier of ZeRO-Infinity's memory hierarchy.

Tensors evicted from CPU memory (optimizer state, master weights, cold
parameters) are written to files under a fast local disk and read back
into caller-owned tensors.  Design choices, and why:

* Asynchronous.  ``write``/``read`` only enqueue work and return a
  :class:`SwapHandle`; a small pool of IO threads does ``os.pwritev`` /
  ``os.preadv`` (which release the GIL) in ``block_size`` chunks, so the
  training step overlaps with disk traffic.  At most ``queue_depth``
  chunks are in flight, one per IO thread.
* O_DIRECT.  Bypassing the page cache keeps swapped state from evicting
  useful memory and gives the disk's real bandwidth.  O_DIRECT wants
  4096-byte aligned buffers, offsets and sizes, and ``torch.empty`` is only
  64-byte aligned, so every IO thread owns a page-aligned slot of an
  anonymous-mmap bounce-buffer pool (pinned on CUDA machines); tensor bytes
  are copied through it and files are padded to 4096 bytes (the true size
  is kept in memory).  Page-aligned CPU tensors (e.g. pinned ones) skip the
  bounce copy, as does buffered IO.  Filesystems that reject O_DIRECT
  (EINVAL) fall back to buffered IO once, with a warning.
* Crash safety.  A write never touches the file that holds the key's
  current version, so a failed write (e.g. disk full) leaves the previous
  version intact:

  - ``reuse_files=True`` (default): each key has two files, ``<key>.a`` and
    ``<key>.b``.  A write overwrites the one *not* holding the current
    version (the key's previous version, kept as a spare), and the key
    flips to it once the write completed; which side is current lives in
    memory (the folder never outlives the engine).  Why: overwriting
    blocks a file already owns needs no allocation, no unwritten-extent
    conversion and no create/rename/unlink, so the filesystem journal stays
    out of the write path.  On this project's VM that made 1.3 MB writes
    3.3x faster (``benchmarks/swap_rewrite.py``).  It costs up
    to twice the disk space of keys written more than once, and a rewrite
    can no longer run out of space once both files exist.
  - ``reuse_files=False``: each write goes to ``<key>.v<N>.tmp``, renamed
    onto the key's file when complete (one file per key, more metadata
    work per write).

  Either way a failed write removes a file it created and reverts the key.
* Ordering.  Requests on the same key run in submission order (a read
  after a write sees the write); requests on different keys run
  concurrently.
* No leaks.  Each engine owns ``<nvme_path>/zinf-<pid>-rank<r>-<random>``
  (mode 0700), removed by :meth:`SwapEngine.close` (called when the model's
  ``RuntimeContext`` that owns the engine is freed), by garbage collection or
  at interpreter exit; directories of dead runs (their ``.lock`` no longer
  flock-held) are swept when a new engine starts.

Errors: a bad ``nvme_path`` raises :class:`SwapPathError` and a full disk
raises :class:`SwapSpaceError` from ``handle.wait()``; both subclass
:class:`SwapError`, itself an ``OSError``.  Other IO errors are re-raised
unchanged by ``wait()``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import queue
import resource
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import warnings
import weakref
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

__all__ = ["SwapConfig", "SwapEngine", "SwapHandle", "SwapError", "SwapPathError", "SwapSpaceError",
           "SwapCorruptError"]

ALIGN = 4096
_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


log = logging.getLogger("zinf_runtime.swap")

class SwapError(OSError):
    """Base class of errors raised by the swap engine."""


class SwapPathError(SwapError):
    """``nvme_path`` is missing, not a directory or not writable."""


class SwapSpaceError(SwapError):
    """The swap filesystem ran out of space (ENOSPC/EFBIG/EDQUOT)."""


class SwapCorruptError(SwapError):
    """A swap file read back differs from what was written: a checksum mismatch or a truncated file."""


def _hardware_crc32c() -> Optional[Callable[[int, int], int]]:
    """CRC-32C of ``n`` bytes at an address, from the crc32c library that the ``google-crc32c`` wheel
    ships (SSE4.2 / ARMv8 instructions), called through ctypes so the GIL is released and no copy is
    made (its Python API takes only ``bytes``). None when it is not installed or not loadable.

    Why: zlib's crc32 ran at about 2 GB/s per thread here, and the profile of an NVMe training step
    on two cores put 15% of all CPU samples in it (``crc32_z``); the library runs at about 18 GB/s.
    """
    try:
        import glob

        import google_crc32c
    except ImportError:
        return None
    libs = os.path.join(os.path.dirname(google_crc32c.__file__), os.pardir, "google_crc32c.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*"))):
        try:
            fn = ctypes.CDLL(path).crc32c_value
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t]
        if fn(ctypes.cast(ctypes.c_char_p(b"123456789"), ctypes.c_void_p), 9) == 0xE3069283:  # the check value
            return fn
    return None


_CRC32C = _hardware_crc32c()
CHECKSUM = "crc32c" if _CRC32C is not None else "crc32"  # what SwapEngine.stats()["checksum"] reports


def _checksum(buf: memoryview) -> int:
    """The block checksum: hardware CRC-32C when available, else zlib's crc32 (both release the GIL)."""
    if _CRC32C is None or not len(buf):
        return zlib.crc32(buf)
    return _CRC32C(ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)), len(buf))


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _past_fsize_limit(end: int) -> bool:
    """True if writing up to ``end`` exceeds RLIMIT_FSIZE (the kernel then shortens or refuses it)."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft != resource.RLIM_INFINITY and end > soft


@dataclass(frozen=True)
class SwapConfig:
    """Swap engine settings; validated eagerly so typos fail at startup."""

    nvme_path: str
    block_size: int = 1 << 20  # bytes per pread/pwrite call
    queue_depth: int = 8  # IO threads == chunks in flight
    buffer_count: int = 4  # bounce-buffer pool: buffer_count mmaps ...
    buffer_size: int = 64 << 20  # ... of buffer_size bytes at most
    direct_io: bool = True  # O_DIRECT, falls back to buffered if unsupported
    checksum: bool = True  # CRC-32C (hardware) or crc32 of every block, kept in memory, verified on read
    reuse_files: bool = True  # two files per key, the spare overwritten in place (see the module docstring)

    def __post_init__(self) -> None:
        def bad(field: str, fix: str) -> ValueError:
            return ValueError(f"SwapConfig.{field}={getattr(self, field)!r} is invalid; fix: {fix}")

        if not isinstance(self.nvme_path, str) or not self.nvme_path:
            raise bad("nvme_path", "pass a non-empty directory path on a fast local disk, e.g. '/local_nvme'")

        def pos_int(field: str) -> int:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(field, "use a positive int")
            return v

        bs = pos_int("block_size")
        if bs % ALIGN:
            raise bad("block_size", f"use a multiple of {ALIGN} (O_DIRECT alignment), e.g. 1<<20")
        if pos_int("queue_depth") > 256:
            raise bad("queue_depth", "use 1..256 (one IO thread per request in flight)")
        pos_int("buffer_count")
        if pos_int("buffer_size") % bs:
            raise bad("buffer_size", f"use a multiple of block_size={bs}")
        if self.buffer_count * (self.buffer_size // bs) < self.queue_depth:
            raise bad("buffer_count", f"raise buffer_count*buffer_size to >= queue_depth*block_size "
                      f"= {self.queue_depth * bs} bytes (one block-sized bounce slot per IO thread)")
        if not isinstance(self.direct_io, bool):
            raise bad("direct_io", "use True or False")
        if not isinstance(self.checksum, bool):
            raise bad("checksum", "use True or False")
        if not isinstance(self.reuse_files, bool):
            raise bad("reuse_files", "use True or False")


class _BouncePool:
    """Page-aligned bounce slots of ``block_size`` carved lazily from up to
    ``buffer_count`` anonymous mmaps of ``buffer_size`` (pinned when CUDA exists)."""

    def __init__(self, cfg: SwapConfig) -> None:
        self._cfg = cfg
        self._per_buf = cfg.buffer_size // cfg.block_size
        self._bufs: list[tuple[mmap.mmap, torch.Tensor]] = []
        self._pinned: list[int] = []
        self._lock = threading.Lock()

    def slot(self, i: int) -> tuple[memoryview, torch.Tensor]:
        """Slot ``i`` as (memoryview for syscalls, uint8 tensor for copies)."""
        b, j = divmod(i, self._per_buf)
        with self._lock:
            while len(self._bufs) <= b:  # map only what queue_depth slots need
                k = len(self._bufs)
                slots = min(self._per_buf, self._cfg.queue_depth - k * self._per_buf)
                m = mmap.mmap(-1, slots * self._cfg.block_size)  # anonymous mmap: page aligned
                t = torch.frombuffer(m, dtype=torch.uint8)
                self._pin(t)
                self._bufs.append((m, t))
            m, t = self._bufs[b]
        lo, hi = j * self._cfg.block_size, (j + 1) * self._cfg.block_size
        return memoryview(m)[lo:hi], t[lo:hi]

    def _pin(self, t: torch.Tensor) -> None:
        """Page-lock the buffer so GPU<->host copies run at DMA speed."""
        try:
            if not torch.cuda.is_available():
                return
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
            self._pinned.append(t.data_ptr())
        except Exception as e:  # pragma: no cover - GPU only
            warnings.warn(f"zinf swap: could not pin bounce buffer ({e}); GPU copies will be slower")

    def close(self) -> None:
        for ptr in self._pinned:  # pragma: no cover - GPU only
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:
                pass
        self._pinned.clear()
        self._bufs.clear()  # mmaps unmap once the last tensor view is gone


class SwapHandle:
    """Completion token of one asynchronous read or write."""

    def __init__(self, kind: str, key: str, data: torch.Tensor, version: int = 0) -> None:
        self.kind, self.key, self.nbytes = kind, key, data.numel()
        self._data, self._version = data, version
        self._path = ""
        self._fd = -1
        self._direct = self._opened_direct = False
        self._crcs: Optional[list[int]] = None  # per block: computed (write) or expected (read)
        self._side: Optional[int] = None  # reuse_files: the file (0 = .a, 1 = .b) a write fills
        self._created = False  # the write created its file (so a failure removes it)
        self._reused = False  # the write overwrites the key's spare (so a failure keeps it the spare)
        self._lock = threading.Lock()
        self._remaining = 0
        self._error: Optional[BaseException] = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self.t_start, self.t_done = time.perf_counter(), 0.0  # submitted, finished (perf_counter)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> "SwapHandle":
        """Block until the IO finished; re-raise its error in the caller."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"swap {self.kind} of {self.key!r} not done after {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def _then(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def __repr__(self) -> str:
        state = "error" if self._error else "done" if self.done() else "pending"
        return f"SwapHandle({self.kind} {self.key!r}, {self.nbytes} B, {state})"


def _cleanup(dirpath: str, lock_fd: int, q: "queue.SimpleQueue", threads: list, pool: _BouncePool,
             owner_pid: int) -> None:
    """Stop IO threads and delete the swap directory (runs once: close/GC/exit)."""
    if os.getpid() != owner_pid:
        return  # a forked child exiting must not delete its parent's swap files
    for _ in threads:
        q.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join()
    pool.close()
    shutil.rmtree(dirpath, ignore_errors=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass


def _worker(q: "queue.SimpleQueue", pool: _BouncePool, index: int) -> None:
    slot = None
    while True:
        task = q.get()
        if task is None:
            return
        if slot is None:
            slot = pool.slot(index)
        task(slot)


def _describe_key(key: str) -> str:
    """``key 'u3.master' (parameter 'fc.weight')`` for the store's ``u<uid>.<kind>`` keys, else the key."""
    text = f"key {key!r}"
    head = key.split(".", 1)[0]
    if head[:1] == "u" and head[1:].isdigit():
        try:
            from . import store  # the store imports this module: look the name up lazily, on errors only

            text += f" of parameter {store.get(int(head[1:])).name!r}"
        except Exception:  # noqa: BLE001 - a name is a courtesy; the key and path are the facts
            pass
    return text


OWNER_FILE = ".owner"  # JSON: who created the folder (see _owner_record)


def _proc_start_time(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), None if no such process.

    With the pid it identifies a process for good: a pid reused by a later process has a later start.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields after "(comm)": state is field 3
    except (ValueError, IndexError):
        return None


def _owner_record() -> dict:
    return {"created_by": "zinf_runtime.swap", "pid": os.getpid(), "host": socket.gethostname(),
            "start_time": _proc_start_time(os.getpid()), "created": time.time()}


def _owner_alive(owner: dict) -> bool:
    """Whether the folder's owner may still run: always True for another host (its pids are not ours)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True  # unreadable marker: leave it
    start = _proc_start_time(pid)
    if start is None:
        return False  # no such process
    return owner.get("start_time") in (None, start)  # a different start time: the pid was reused


def _sweep_stale(root: str) -> list[str]:
    """Remove the swap folders of dead runs under ``root``; return the folders removed.

    A folder goes only when everything says zinf made it and its owner is gone: its name starts with
    ``zinf-``, it holds the ``.lock`` file whose flock the owning engine holds for its lifetime (the
    kernel drops it when the process dies, SIGKILL included) and that flock is free, and its ``.owner``
    marker (pid + host + process start time) names a process of this host that no longer runs (a
    folder of another host sharing the disk is left alone). Anything else is never touched.
    """
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("zinf-"):
            continue
        d = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(d, ".lock"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # not ours, or still being created
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live engine holds it
            try:
                with open(os.path.join(d, OWNER_FILE)) as f:
                    owner = json.load(f)
            except FileNotFoundError:
                owner = None  # a folder of a zinf version without markers: the free flock decides
            except (OSError, ValueError):
                continue  # unreadable marker: not provably ours
            if owner is not None and (not isinstance(owner, dict) or owner.get("created_by") != "zinf_runtime.swap"
                                      or _owner_alive(owner)):
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            os.close(fd)
    return removed


class SwapEngine:
    """Asynchronous tensor swap to files under ``cfg.nvme_path``.

    Raises :class:`SwapPathError` (an ``OSError``) if the path is unusable.
    Thread-safe; the caller must not modify a tensor passed to ``write`` or
    touch the ``out`` of ``read`` until the handle's ``wait()`` returns.
    """

    def __init__(self, cfg: SwapConfig, rank: int = 0) -> None:
        if not isinstance(cfg, SwapConfig):
            raise TypeError(f"cfg must be a SwapConfig, got {type(cfg).__name__}")
        self.cfg, self.rank = cfg, rank
        self._bases: Dict[str, str] = {}  # key -> its files' path stem (``_base``)
        root = os.path.abspath(cfg.nvme_path)
        try:
            if not os.path.isdir(root):
                raise FileNotFoundError(errno.ENOENT, "no such directory") if not os.path.exists(root) \
                    else NotADirectoryError(errno.ENOTDIR, "not a directory")
            self.swept = _sweep_stale(root)  # folders of dead runs, removed
            if self.swept:
                warnings.warn(f"zinf swap: removed {len(self.swept)} swap folder(s) left under {root!r} by "
                              f"crashed runs: {', '.join(os.path.basename(d) for d in self.swept)}", RuntimeWarning,
                              stacklevel=2)
            self.dir = tempfile.mkdtemp(prefix=f"zinf-{os.getpid()}-rank{rank}-", dir=root)  # mode 0700
            with open(os.path.join(self.dir, OWNER_FILE), "w") as f:  # before .lock: a swept folder has one
                json.dump(_owner_record(), f)
            tmp_lock = os.path.join(self.dir, ".lock.tmp")
            lock_fd = os.open(tmp_lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            os.rename(tmp_lock, os.path.join(self.dir, ".lock"))  # visible only once locked
        except OSError as e:
            raise SwapPathError(e.errno or errno.EINVAL,
                                f"zinf swap: cannot use nvme_path {root!r}: {e.strerror or e}; fix: point "
                                f"SwapConfig.nvme_path at an existing, writable directory on a fast local disk "
                                f"(e.g. mkdir -p {root} && chmod u+rwx {root})") from e
        self._direct = cfg.direct_io
        # called with each finished request, on a worker thread: the step trace's nvme_write lane
        self.observer: Optional[Callable[[SwapHandle], None]] = None
        self._warned = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._version = itertools.count(1)
        # key -> (nbytes, file bytes, version, crc32 per block or None, side or None)
        self._files: dict[str, tuple[int, int, int, Optional[list[int]], Optional[int]]] = {}
        self._spares: dict[str, tuple[int, int]] = {}  # reuse_files: key -> (side, file bytes) of its spare
        self._expect: dict[str, tuple[int, int]] = {}  # key -> (nbytes, version) of latest submitted write
        self._tail: dict[str, SwapHandle] = {}  # key -> last request, for per-key ordering
        self._inflight = 0
        self._busy_since = 0.0
        self._st = dict(disk_bytes=0, peak_disk_bytes=0, bytes_written=0, bytes_read=0,
                        busy_s=0.0, writes=0, reads=0, zero_copy_bytes=0)
        self._closed = False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = _BouncePool(cfg)
        self._threads = [threading.Thread(target=_worker, args=(self._q, self._pool, i),
                                          name=f"zinf-swap-{rank}-{i}", daemon=True)
                         for i in range(cfg.queue_depth)]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, lock_fd, self._q, self._threads, self._pool,
                                          os.getpid())

    # ------------------------------------------------------------------ API
    def write(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor``'s bytes (CPU or CUDA) as the new version of ``key``.

        CUDA tensors are copied on the worker's current stream; sync producers first.
        """
        data = self._bytes_of(tensor.contiguous() if not tensor.is_contiguous() else tensor)
        with self._lock:
            self._check_open()
            h = SwapHandle("write", key, data, next(self._version))
            self._expect[key] = (h.nbytes, h._version)
            prev = self._enqueue(h)
        self._chain(prev, h)
        return h

    def read(self, key: str, out: torch.Tensor) -> SwapHandle:
        """Start filling ``out`` (contiguous CPU, any dtype) with ``key``'s bytes."""
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"read({key!r}): out must be a contiguous CPU tensor, got "
                             f"device={out.device} contiguous={out.is_contiguous()}")
        data = self._bytes_of(out)
        with self._lock:
            self._check_open()
            if key not in self._expect:
                raise KeyError(f"swap key {key!r} was never written (or was removed)")
            if self._expect[key][0] != data.numel():
                raise ValueError(f"read({key!r}): out has {data.numel()} bytes but the key holds "
                                 f"{self._expect[key][0]}; pass a tensor of matching size")
            h = SwapHandle("read", key, data)
            prev = self._enqueue(h)
        self._chain(prev, h)
        return h

    def exists(self, key: str) -> bool:
        """True if ``key`` was written (including a still-pending write)."""
        with self._lock:
            return key in self._expect

    def nbytes(self, key: str) -> int:
        """True byte size of ``key``'s latest write; KeyError if absent."""
        with self._lock:
            return self._expect[key][0]

    def remove(self, key: str, keep_file: bool = False) -> None:
        """Delete ``key``; waits for its pending requests first.

        ``keep_file`` (with ``reuse_files``): the key is gone all the same (``exists`` is False, reads
        fail), but its current file stays as its spare, for a key that will be written again with
        the same size (a gradient after ``zero_grad``), so that write overwrites in place."""
        while True:
            with self._lock:
                self._check_open()
                tail = self._tail.get(key)
                if tail is None:
                    self._expect.pop(key, None)
                    ent, spare = self._files.pop(key, None), self._spares.pop(key, None)
                    if keep_file and ent is not None and ent[4] is not None:
                        self._spares[key] = (ent[4], ent[1])
                        ent = None
                    for side, size in ([(ent[4], ent[1])] if ent is not None else []) + ([spare] if spare else []):
                        self._st["disk_bytes"] -= size
                        try:
                            os.unlink(self._path_of(key, side))
                        except FileNotFoundError:
                            pass
                    return
            tail._event.wait()

    def wait_all(self) -> None:
        """Block until every submitted request has finished."""
        with self._idle:
            while self._inflight:
                self._idle.wait()

    def stats(self) -> dict:
        """Disk usage now/peak (padded file bytes), payload bytes moved, request counts
        and ``busy_s`` (wall seconds with any IO in flight, so bandwidth = bytes / busy_s)."""
        with self._lock:
            s = dict(self._st)
            if self._inflight:
                s["busy_s"] += time.perf_counter() - self._busy_since
            s.update(keys=len(self._files), direct_io=self._direct, dir=self.dir,
                     checksum=CHECKSUM if self.cfg.checksum else None)
            return s

    def close(self) -> None:
        """Finish pending IO, stop the threads and delete the swap directory.

        A no-op once the finalizer ran (garbage collection, or interpreter exit, where finalizers
        run newest first: an engine's own before its owning context's): its IO threads are gone,
        so waiting for IO still queued would never return.
        """
        if self._closed or not self._finalizer.alive:
            self._closed = True
            return
        self.wait_all()
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "SwapEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SwapEngine is closed")

    @staticmethod
    def _bytes_of(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8)

    def _base(self, key: str) -> str:
        """The path stem of ``key``'s files, made once per key: quoting runs Python per character
        (about 2 us a key), and an NVMe optimizer asks again for every state it writes at every step,
        on the main thread."""
        base = self._bases.get(key)
        if base is None:
            # quote() leaves '.' alone; escape it so '<name>.v<N>.tmp' or '<name>.a' can't collide with a key.
            name = urllib.parse.quote(key, safe="").replace(".", "%2E")
            base = self._bases[key] = os.path.join(self.dir, "k_" + name)
        return base

    def _path_of(self, key: str, side: Optional[int]) -> str:
        """The file of one side of ``key`` (``None``: the single file of ``reuse_files=False``)."""
        return self._base(key) if side is None else f"{self._base(key)}.{'ab'[side]}"

    def _file(self, key: str) -> str:
        """The file holding ``key``'s current version (where reads go)."""
        with self._lock:
            ent = self._files.get(key)
        return self._path_of(key, ent[4] if ent is not None else (0 if self.cfg.reuse_files else None))

    def _enqueue(self, h: SwapHandle) -> Optional[SwapHandle]:
        """Register ``h`` as the key's newest request (lock held); return its predecessor."""
        prev = self._tail.get(h.key)
        self._tail[h.key] = h
        if self._inflight == 0:
            self._busy_since = time.perf_counter()
        self._inflight += 1
        return prev

    def _chain(self, prev: Optional[SwapHandle], h: SwapHandle) -> None:
        if prev is None:
            self._start(h)
        else:
            prev._then(lambda: self._start(h))

    # IO hooks: thin wrappers so tests can inject faults.
    def _sys_open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o600)

    def _sys_pwritev(self, fd: int, bufs: list, offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def _sys_preadv(self, fd: int, bufs: list, offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def _fallback(self, path: str, err: OSError) -> None:
        """Switch the engine to buffered IO, warning once."""
        self._direct = False
        if not self._warned:
            self._warned = True
            warnings.warn(f"zinf swap: O_DIRECT not supported for {path!r} ({err.strerror}); "
                          f"falling back to buffered IO (uses page cache)", RuntimeWarning, stacklevel=2)

    def _start(self, h: SwapHandle) -> None:
        """Open the request's file and queue its chunks (runs once its predecessor is done)."""
        try:
            padded = _round_up(h.nbytes)
            if h.kind == "write":
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                with self._lock:  # the key's earlier requests are done: its files are settled
                    if self.cfg.reuse_files:
                        ent, spare = self._files.get(h.key), self._spares.pop(h.key, None)
                        h._side = spare[0] if spare is not None else 0 if ent is None else 1 - ent[4]
                        if spare is not None and spare[1] == padded:  # overwrite the spare in place
                            flags &= ~(os.O_CREAT | os.O_EXCL)
                            h._reused = True
                        elif spare is not None:  # another size: replaced by a new file
                            try:
                                os.unlink(self._path_of(h.key, h._side))
                            except FileNotFoundError:
                                pass
                            except OSError:
                                self._spares[h.key] = spare  # still on disk, still the spare
                                raise
                            self._st["disk_bytes"] -= spare[1]
                        h._path = self._path_of(h.key, h._side)
                    else:
                        h._path = f"{self._base(h.key)}.v{h._version}.tmp"
                    h._created = bool(flags & os.O_CREAT)
                    if h._created:
                        self._st["disk_bytes"] += padded
                        self._st["peak_disk_bytes"] = max(self._st["peak_disk_bytes"], self._st["disk_bytes"])
            else:
                with self._lock:
                    ent = self._files.get(h.key)
                if ent is None or ent[0] != h.nbytes:
                    raise KeyError(f"swap key {h.key!r} has no readable version of {h.nbytes} bytes "
                                   f"(a preceding write failed?)")
                h._path = self._path_of(h.key, ent[4])
                h._crcs = ent[3]
                flags = os.O_RDONLY | os.O_CLOEXEC
            h._direct = h._opened_direct = self._direct
            try:
                h._fd = self._sys_open(h._path, flags | (os.O_DIRECT if h._direct else 0))
            except OSError as e:
                if not h._direct or e.errno != errno.EINVAL:
                    raise
                self._fallback(h._path, e)
                h._direct = h._opened_direct = False
                h._fd = self._sys_open(h._path, flags & ~os.O_EXCL)  # the failed open may have created it
            if h.kind == "write" and h.nbytes and h._created:
                try:  # reserve space up front: early ENOSPC, and parallel O_DIRECT writes skip the inode lock
                    os.posix_fallocate(h._fd, 0, _round_up(h.nbytes))
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
        except BaseException as e:  # noqa: BLE001 - delivered through wait()
            h._error = e
            self._finish(h)
            return
        bs = self.cfg.block_size
        offsets = range(0, h.nbytes, bs)
        if h.kind == "write" and self.cfg.checksum:
            h._crcs = [0] * len(offsets)
        h._remaining = len(offsets)
        if not offsets:
            self._finish(h)
        for off in offsets:
            self._q.put(lambda slot, off=off: self._chunk(h, off, slot))

    def _chunk(self, h: SwapHandle, off: int, slot: tuple[memoryview, torch.Tensor]) -> None:
        """Move one block between the bounce slot and the file."""
        try:
            if h._error is None:
                n = min(self.cfg.block_size, h.nbytes - off)
                padded = _round_up(n)
                mv, t = slot
                zc = self._zero_copy(h, off, n)
                if zc is not None:  # IO straight from/into the tensor, no bounce copy
                    if h.kind == "write":
                        self._sum(h, off, zc[:n])
                    self._io(h, self._sys_pwritev if h.kind == "write" else self._sys_preadv, zc, off,
                             need=None if h.kind == "write" else n)
                    if h.kind == "read":
                        self._sum(h, off, zc[:n])
                    with self._lock:
                        self._st["zero_copy_bytes"] += n
                elif h.kind == "write":
                    t[:n].copy_(h._data[off:off + n])
                    if padded > n:
                        t[n:padded].zero_()
                    self._sum(h, off, mv[:n])
                    self._io(h, self._sys_pwritev, mv[:padded], off)
                else:
                    self._io(h, self._sys_preadv, mv[:padded], off, need=n)
                    self._sum(h, off, mv[:n])
                    h._data[off:off + n].copy_(t[:n])
        except BaseException as e:  # noqa: BLE001
            if h.kind == "read" and not isinstance(e, SwapCorruptError):
                e = self._truncated(h, e) or e
            with h._lock:
                if h._error is None:
                    h._error = e
        with h._lock:
            h._remaining -= 1
            last = h._remaining == 0
        if last:
            self._finish(h)

    def _sum(self, h: SwapHandle, off: int, buf: memoryview) -> None:
        """Record (write) or verify (read) the checksum (``CHECKSUM``) of one block's payload bytes.

        Both checksums release the GIL, so the IO threads checksum in parallel; a read
        whose bytes differ from what was written raises, naming the file and its key.
        """
        if h._crcs is None:
            return
        i = off // self.cfg.block_size
        crc = _checksum(buf)
        if h.kind == "write":
            h._crcs[i] = crc
        elif crc != h._crcs[i]:
            raise SwapCorruptError(
                errno.EIO, f"zinf swap: file {h._path!r} ({_describe_key(h.key)}) is corrupt: bytes {off}..{off + len(buf)} "
                f"read back with {CHECKSUM} {crc:#010x}, written with {h._crcs[i]:#010x}. Something else wrote to "
                f"the swap folder, or the disk returned bad data; fix: check the disk under "
                f"{self.cfg.nvme_path!r} (dmesg, smartctl) and restart from the last checkpoint. "
                f"(SwapConfig.checksum / option nvme_checksum=False skips this check.)")

    @staticmethod
    def _truncated(h: SwapHandle, err: BaseException) -> Optional["SwapCorruptError"]:
        """A read error explained by the file being shorter than its payload, as a SwapCorruptError."""
        try:
            size = os.fstat(h._fd).st_size
        except OSError:
            return None
        if size >= h.nbytes:
            return None
        e = SwapCorruptError(
            errno.EIO, f"zinf swap: file {h._path!r} ({_describe_key(h.key)}) is truncated: {size} bytes on disk, "
            f"{h.nbytes} were written. Something else truncated or replaced it (or the disk lost data); fix: "
            f"check the disk under {os.path.dirname(os.path.dirname(h._path))!r} and restart from the last "
            f"checkpoint")
        e.__cause__ = err
        return e

    @staticmethod
    def _zero_copy(h: SwapHandle, off: int, n: int) -> Optional[memoryview]:
        """A view of the tensor's own bytes when the bounce copy is unnecessary: CPU memory
        and either buffered IO or a page-aligned address and length (e.g. pinned tensors)."""
        if h._data.device.type != "cpu":
            return None
        addr = h._data.data_ptr() + off
        if h._direct and (addr % ALIGN or n % ALIGN):
            return None
        return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")

    def _io(self, h: SwapHandle, fn: Callable, buf: memoryview, off: int, need: Optional[int] = None) -> None:
        """pwritev/preadv all of ``buf`` at ``off``, handling short IO and O_DIRECT refusal."""
        done, total = 0, len(buf) if need is None else need
        retried = False
        while done < total:
            try:
                r = fn(h._fd, [buf[done:]], off + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not h._opened_direct or retried:
                    raise
                if need is None and _past_fsize_limit(off + len(buf)):
                    # RLIMIT_FSIZE cut the write to an unaligned length: that is "file too large"
                    raise OSError(errno.EFBIG, os.strerror(errno.EFBIG)) from e
                if done:  # unaligned remainder after short IO; for writes: the disk/limit is full
                    if need is not None:
                        raise
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from e
                with h._lock:  # the filesystem refuses O_DIRECT IO: clear the flag on this fd
                    if h._direct:
                        fl = fcntl.fcntl(h._fd, fcntl.F_GETFL)
                        fcntl.fcntl(h._fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
                        h._direct = False
                        self._fallback(h._path, e)
                retried = True
                continue
            if r == 0:
                if need is not None:
                    raise EOFError(f"swap file {h._path!r} is truncated at {off + done}")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += r

    def _finish(self, h: SwapHandle) -> None:
        """Close the fd, commit or roll back a write, update stats, wake waiters."""
        if h._fd >= 0:
            try:
                os.close(h._fd)
            except OSError as e:
                h._error = h._error or e
            h._fd = -1
        padded = _round_up(h.nbytes)
        with self._lock:
            if h.kind == "write":
                if h._error is None and h._side is None:
                    try:
                        os.replace(h._path, self._base(h.key))
                    except OSError as e:
                        h._error = e
                if h._error is None:
                    old = self._files.get(h.key)
                    self._files[h.key] = (h.nbytes, padded, h._version, h._crcs, h._side)
                    if h._side is None:
                        self._st["disk_bytes"] -= old[1] if old else 0
                    elif old is not None:  # the previous version's file is the next write's spare
                        self._spares[h.key] = (old[4], old[1])
                    self._st["bytes_written"] += h.nbytes
                    self._st["writes"] += 1
                else:
                    if h._created:
                        self._st["disk_bytes"] -= padded
                        if h._path:
                            try:
                                os.unlink(h._path)
                            except OSError:
                                pass
                    elif h._reused:  # an overwritten spare stays the spare (its bytes are garbage, never read)
                        self._spares[h.key] = (h._side, padded)
                    if self._expect.get(h.key, (0, 0))[1] == h._version:  # no newer write: revert
                        old = self._files.get(h.key)
                        if old is None:
                            self._expect.pop(h.key, None)
                        else:
                            self._expect[h.key] = (old[0], old[2])
                    e = h._error
                    if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS and not isinstance(e, SwapError):
                        h._error = SwapSpaceError(
                            e.errno, f"zinf swap: out of space writing {_describe_key(h.key)} to {h._path!r}: needs "
                            f"{padded} bytes ({h.nbytes} payload); fix: free space on "
                            f"{self.cfg.nvme_path!r}, point nvme_path at a larger disk or swap less. Writes are "
                            f"atomic: the key keeps its previous version, if it had one")
                        h._error.__cause__ = e
            elif h._error is None:
                self._st["bytes_read"] += h.nbytes
                self._st["reads"] += 1
            if self._tail.get(h.key) is h:
                del self._tail[h.key]
            self._inflight -= 1
            if self._inflight == 0:
                self._st["busy_s"] += time.perf_counter() - self._busy_since
                self._idle.notify_all()
        h._data = None  # drop the tensor reference promptly
        h.t_done = time.perf_counter()
        if self.observer is not None:  # the step trace's nvme_write lane (runtime/context.py)
            try:
                self.observer(h)
            except Exception:  # noqa: BLE001 - a trace must never fail the IO it watches
                log.debug("swap observer failed", exc_info=True)
        with h._lock:
            h._event.set()
            cbs, h._callbacks = h._callbacks, []
        for cb in cbs:  # via the queue, not inline: long same-key chains must not recurse
            self._q.put(lambda slot, cb=cb: cb())
