"""Cost model without profiling runs: link bandwidths measured once per machine and cached on disk.

Why: DeepCompile profiles every node 15 times on real inputs, then resets Dynamo and recompiles at
step 5; zinf's schedule is in operator units and needs no per-node timings. What a planner does
need are the speeds of the links a parameter crosses, and those belong to the machine, not the
model: measure them once with a microbenchmark of a few seconds and keep the figures in a small
JSON file, keyed by what determines them::

    key = hostname + compute device name + dp world size + the nvme path's filesystem
          (mount point, filesystem type, source device; a path on tmpfs and one on the NVMe drive
          get two entries)
    ~/.cache/zinf/bandwidth-<sha1(key)[:16]>.json   (or $ZINF_CACHE_DIR, or cache_dir=...)
        {"version": 1, "key": {...}, "disk_read": B/s, "disk_write": B/s, "h2d": B/s, "d2h": B/s,
         "all_gather": {"65536": B/s, ...}, "reduce_scatter": {...}, "measure_s": 1.8, ...}

Links measured:
  * disk write / read: zinf's own ``SwapEngine`` (its block size, queue depth, O_DIRECT and
    checksum settings) writing then reading one ``measure_bytes`` tensor in a temporary folder
    under the nvme path, removed afterwards;
  * host -> device and device -> host: ``copy_`` of ``measure_bytes`` between (pinned, on CUDA) host
    memory and the compute device; without CUDA the "device" is the CPU and this is a memcpy;
  * all-gather and reduce-scatter (dp > 1 only, collective: every rank calls ``bandwidths``) at a
    few sizes, on the process group's device. Their B/s is the full (gathered) buffer's bytes over
    the time: what a parameter of that size costs.

A corrupt or unreadable cache file is re-measured with a warning; ``refresh=True`` re-measures on
purpose. With dp > 1 the ranks agree first (one all-reduce) whether any of them must measure, so a
rank with a cache never skips a collective another rank runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

VERSION = 1
DEFAULT_MEASURE_BYTES = 32 << 20
DEFAULT_COLLECTIVE_SIZES = (64 << 10, 1 << 20, 16 << 20)
_LINKS = ("disk_read", "disk_write", "h2d", "d2h")


@dataclass(frozen=True)
class Bandwidths:
    """Measured link speeds in bytes per second (None: not measured, e.g. no nvme path)."""

    key: Dict[str, Any]
    disk_read: Optional[float]
    disk_write: Optional[float]
    h2d: float
    d2h: float
    all_gather: Dict[int, float] = field(default_factory=dict)
    reduce_scatter: Dict[int, float] = field(default_factory=dict)
    measure_bytes: int = DEFAULT_MEASURE_BYTES
    measure_s: float = 0.0
    measured_at: str = ""
    direct_io: Optional[bool] = None
    path: Optional[str] = None  # the cache file it came from or went to (not stored)
    cached: bool = False  # True: read from the cache, not measured by this call (not stored)

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("path"), d.pop("cached")
        d["all_gather"] = {str(k): v for k, v in self.all_gather.items()}
        d["reduce_scatter"] = {str(k): v for k, v in self.reduce_scatter.items()}
        d["version"] = VERSION
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], path: Optional[str] = None) -> "Bandwidths":
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} bandwidth record")
        names = {f.name for f in dataclasses.fields(cls)} - {"path", "cached"}
        missing = [n for n in ("key", *_LINKS) if n not in d]
        if missing:
            raise ValueError(f"missing fields {missing}")
        kw = {k: v for k, v in d.items() if k in names}
        for coll in ("all_gather", "reduce_scatter"):
            kw[coll] = {int(k): float(v) for k, v in (d.get(coll) or {}).items()}
        for link in _LINKS:
            v = kw[link]
            if v is not None and (not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{link} = {v!r} is not a positive rate")
        return cls(**kw, path=path, cached=True)

    def collective(self, kind: str, nbytes: int) -> Optional[float]:
        """B/s of ``kind`` ("all_gather"/"reduce_scatter") for a buffer of ``nbytes``: the nearest
        measured size at or above it (the largest if none), None at dp = 1."""
        table = getattr(self, kind)
        if not table:
            return None
        above = [s for s in sorted(table) if s >= nbytes]
        return table[above[0] if above else max(table)]

    def seconds(self, link: str, nbytes: int) -> Optional[float]:
        """Predicted seconds to move ``nbytes`` over ``link`` (a field name), None if not measured."""
        bw = self.collective(link, nbytes) if link in ("all_gather", "reduce_scatter") else getattr(self, link)
        return None if not bw else nbytes / bw


# -- the key -----------------------------------------------------------------------------------------

def filesystem_of(path: str) -> Dict[str, Any]:
    """The filesystem holding ``path``: its mount point, type and source (from /proc/self/mounts,
    longest matching mount point), and ``st_dev``."""
    real = os.path.realpath(path)
    info: Dict[str, Any] = {"mount": None, "fstype": None, "source": None, "st_dev": os.stat(real).st_dev}
    try:
        with open("/proc/self/mounts") as f:
            best = ""
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best = mnt
                    info.update(mount=mnt, fstype=parts[2], source=parts[0])
    except OSError:  # not Linux: st_dev alone tells filesystems apart
        pass
    return info


def device_name(device: Optional[torch.device] = None) -> str:
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()} cores"


def machine_key(nvme_path: Optional[str] = None, *, device: Optional[torch.device] = None,
                world: int = 1, swap: Any = None) -> Dict[str, Any]:
    """What the figures depend on: the host, the compute device, the dp size, the disk and the swap
    engine's settings (block size, queue depth, O_DIRECT, checksums)."""
    key: Dict[str, Any] = {"host": socket.gethostname(), "device": device_name(device), "world": int(world),
                           "nvme": None if nvme_path is None else filesystem_of(nvme_path),
                           "torch": torch.__version__}
    if nvme_path is not None:
        from zinf_runtime.swap import SwapConfig

        cfg = swap if swap is not None else SwapConfig(nvme_path)
        key["swap"] = {k: getattr(cfg, k) for k in ("block_size", "queue_depth", "direct_io", "checksum")}
    return key


def cache_dir_default() -> str:
    return os.environ.get("ZINF_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zinf")


def cache_path(key: Dict[str, Any], cache_dir: Optional[str] = None) -> str:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or cache_dir_default(), f"bandwidth-{digest}.json")


# -- measuring ---------------------------------------------------------------------------------------

def _best(fn: Callable[[], None], repeat: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_disk(nvme_path: str, nbytes: int, swap: Any) -> tuple:
    from zinf_runtime.swap import SwapConfig, SwapEngine

    root = tempfile.mkdtemp(prefix="zinf-bw-", dir=nvme_path)
    try:
        cfg = swap if swap is not None else SwapConfig(root)
        cfg = dataclasses.replace(cfg, nvme_path=root)
        eng = SwapEngine(cfg, 0)
        try:
            data = torch.randn(nbytes // 4)
            out = torch.empty_like(data)
            eng.write("warm", data[: 1 << 18]).wait()  # files and threads exist before timing
            eng.read("warm", out[: 1 << 18]).wait()
            t0 = time.perf_counter()
            eng.write("bw", data).wait()
            wt = time.perf_counter() - t0
            t0 = time.perf_counter()
            eng.read("bw", out).wait()
            rt = time.perf_counter() - t0
            if not torch.equal(out, data):
                raise RuntimeError(f"zinf bandwidth: the swap engine read back other bytes than it wrote under "
                                   f"{nvme_path}; the disk or the engine is broken")
            direct = bool(eng.stats().get("direct_io"))
        finally:
            eng.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return nbytes / rt, nbytes / wt, direct


def _measure_copies(device: torch.device, nbytes: int, repeat: int) -> tuple:
    host = torch.empty(nbytes // 4)
    if device.type == "cuda":
        host = host.pin_memory()
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    else:
        sync = lambda: None  # noqa: E731
    dev = torch.empty(nbytes // 4, device=device)
    h2d = _best(lambda: dev.copy_(host, non_blocking=True), repeat, sync)
    d2h = _best(lambda: host.copy_(dev, non_blocking=True), repeat, sync)
    return nbytes / h2d, nbytes / d2h


def _measure_collectives(group: Any, sizes: Sequence[int], repeat: int) -> tuple:
    import torch.distributed as dist

    from zinf_runtime import comm

    world = comm.world_size(group)
    dev = comm.group_device(group, torch.device("cuda") if torch.cuda.is_available() else None)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    ag: Dict[int, float] = {}
    rs: Dict[int, float] = {}
    for size in sizes:
        n = max(world, size // 4 // world * world)
        full = torch.zeros(n, device=dev)
        shard = torch.zeros(n // world, device=dev)

        def gather() -> None:
            comm.all_gather_flat(full, shard, group)

        def scatter() -> None:
            comm.reduce_scatter_flat(shard, full, group)

        dist.barrier(group=group)
        ag[size] = 4 * n / _best(gather, repeat, sync)
        dist.barrier(group=group)
        rs[size] = 4 * n / _best(scatter, repeat, sync)
    return ag, rs


def measure(nvme_path: Optional[str] = None, *, group: Any = None, device: Optional[torch.device] = None,
            measure_bytes: int = DEFAULT_MEASURE_BYTES, sizes: Sequence[int] = DEFAULT_COLLECTIVE_SIZES,
            repeat: int = 3, swap: Any = None) -> Bandwidths:
    """Run the microbenchmark now (collective when dp > 1); nothing is cached."""
    from zinf_runtime import comm

    if measure_bytes < (1 << 20) or measure_bytes % 4096:
        raise ValueError(f"zinf bandwidth: measure_bytes must be a multiple of 4096 and >= 1 MiB, got {measure_bytes}")
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    t0 = time.perf_counter()
    world = comm.world_size(group)
    rd = wr = direct = None
    if nvme_path is not None:
        rd, wr, direct = _measure_disk(nvme_path, measure_bytes, swap)
    h2d, d2h = _measure_copies(dev, measure_bytes, repeat)
    ag, rs = _measure_collectives(group, sizes, repeat) if world > 1 else ({}, {})
    return Bandwidths(key=machine_key(nvme_path, device=dev, world=world, swap=swap), disk_read=rd, disk_write=wr, h2d=h2d,
                      d2h=d2h, all_gather=ag, reduce_scatter=rs, measure_bytes=measure_bytes,
                      measure_s=time.perf_counter() - t0,
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), direct_io=direct)


def _read_cache(path: str, key: Dict[str, Any]) -> Optional[Bandwidths]:
    """The cached record, or None (absent); a corrupt one warns and reads as absent."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            bw = Bandwidths.from_json(json.load(f), path)
        if bw.key != key:
            raise ValueError("its key is another machine's")
        return bw
    except (OSError, ValueError, TypeError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"zinf bandwidth: the cache file {path} is unusable ({type(exc).__name__}: {exc}); "
                      "measuring again and overwriting it", RuntimeWarning, stacklevel=3)
        return None


def _write_cache(path: str, bw: Bandwidths) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".bandwidth-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(bw.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def bandwidths(nvme_path: Optional[str] = None, *, cache_dir: Optional[str] = None, group: Any = None,
               device: Optional[torch.device] = None, refresh: bool = False,
               measure_bytes: int = DEFAULT_MEASURE_BYTES, sizes: Sequence[int] = DEFAULT_COLLECTIVE_SIZES,
               swap: Any = None) -> Bandwidths:
    """This machine's link speeds: from the cache if it holds this key, else measured and cached.

    Collective when dp > 1 (``group``'s ranks, or the default group's, all call it).
    """
    from zinf_runtime import comm

    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise ValueError(f"zinf bandwidth: nvme path {nvme_path!r} is not an existing directory; create it first")
    dev = torch.device(device) if device is not None else None
    world = comm.world_size(group)
    key = machine_key(nvme_path, device=dev, world=world, swap=swap)
    path = cache_path(key, cache_dir)
    found = None if refresh else _read_cache(path, key)
    if world > 1:  # measure together or not at all: the collectives must match
        need = torch.tensor([0.0 if found is not None else 1.0])
        comm.all_reduce_sum(need, group)
        if need.item() > 0:
            found = None
    if found is not None:
        return found
    bw = measure(nvme_path, group=group, device=dev, measure_bytes=measure_bytes, sizes=sizes, swap=swap)
    bw = dataclasses.replace(bw, key=key)
    _write_cache(path, bw)  # atomic: ranks sharing a host (and the file) each leave a whole record
    return dataclasses.replace(bw, path=path, cached=False)


def format_table(bw: Bandwidths) -> str:
    """The figures as the ``zinf bandwidth`` command prints them."""
    def rate(v: Optional[float]) -> str:
        return "-" if v is None else f"{v / 1e9:.3g} GB/s"

    key = bw.key
    fs = key.get("nvme") or {}
    lines = [f"host {key['host']}, device {key['device']}, dp {key['world']}"
             + (f", nvme path on {fs.get('fstype')} {fs.get('source')} (mounted at {fs.get('mount')})" if fs else ""),
             f"{'link':<28}{'bandwidth':>14}",
             f"{'disk read (swap engine)':<28}{rate(bw.disk_read):>14}",
             f"{'disk write (swap engine)':<28}{rate(bw.disk_write):>14}",
             f"{'host -> device':<28}{rate(bw.h2d):>14}",
             f"{'device -> host':<28}{rate(bw.d2h):>14}"]
    for kind in ("all_gather", "reduce_scatter"):
        for size, v in sorted(getattr(bw, kind).items()):
            lines.append(f"{kind.replace('_', '-') + f' {size / 2**20:g} MiB':<28}{rate(v):>14}")
    how = "read from cache" if bw.cached else f"measured in {bw.measure_s:.2f} s"
    lines.append(f"{how} ({bw.measured_at}, {bw.measure_bytes >> 20} MiB per transfer"
                 + ("" if bw.direct_io is None else f", O_DIRECT {bw.direct_io}") + f"): {bw.path}")
    return "\n".join(lines)
