"""Swap engine bandwidth against fio doing the same IO, on the same disk, in the same run.

Why: ZeRO-Infinity's NVMe tier is only worth it if the engine keeps the disk busy. The figure that
matters is engine GB/s / disk GB/s, and the best the engine can do is match the disk (ratio 1.0).
A ratio above 1 means the two sides did not do the same work, so this script makes them do it:

* **Same IO.** The engine writes ``n`` tensors of ``--tensor-mib`` (one file each, reserved with
  ``posix_fallocate``) in ``--block-kib`` chunks, with ``--queue-depth`` chunks in flight, taking the
  files one after another. fio does the same twice over, as two references: ``fio_libaio`` (libaio,
  one thread, ``iodepth`` = queue depth, ``nrfiles`` = n, ``file_service_type=sequential``) and
  ``fio_psync`` (queue-depth threads doing one blocking request each, the engine's own structure, so
  both sides also get the same share of a contended CPU); both with the same ``bs``, the same files
  of the same size, ``fallocate=posix`` and ``direct=1``.
* **Same files for reads.** Both sides read the *engine's* files (fio gets them by name), so file
  layout and whatever cache sits below the guest are the same for both.
* **O_DIRECT on both sides**, and it is checked rather than assumed: the bytes that the block device
  actually moved during each phase (``/proc/diskstats``) are reported next to the payload. If a side
  moved much less than its payload, the page cache served it, and no ratio is printed. With the
  guest's page cache bypassed (and checked), dropping caches is not needed; a cache below a VM (the
  host's) cannot be dropped from inside it, and only a ``--size-gib`` larger than that cache defeats it.
* **The disk's ceiling.** ``fio_libaio_deep`` runs the same files with 4x the requests in flight:
  not the same IO, but what the disk can do. "best fio" includes it, so an engine/best-fio ratio
  above 1 would mean the engine outran every fio configuration tried.
* **Rotating order.** Each run rotates which side goes first (writes and reads), so background load
  and the disk's own drift hit every side alike. Every run is printed; the ratio reported is the
  median over runs of engine / (the faster fio reference of the same run), not a ratio of medians.
* **Device counters are device-wide.** Other processes' IO on the same disk during a phase adds to
  its ``device moved`` (it can exceed 1.0) and to its request sizes: on a shared machine these
  figures can only show that a side did *not* reach the device, never prove that it alone did.
* **Same IO at the device.** The mean request size the device completed (``/proc/diskstats``) is
  printed per side; if the sides differ by more than 10%, a NOTE says they did not do the same IO.
* **No silent baseline.** Without fio the script says so, prints the engine's figures alone and no
  ratio, and exits with status 2. (It never falls back to ``dd``: dd issues one request at a time, so
  it measures queue depth 1 and makes any engine look faster than the disk.)

Why earlier figures showed engine/fio 1.16-1.30 (measured here, see benchmarks/README.md): the two
sides did not do the same IO. (1) fio wrote and read one 1 GiB file of its own, the engine eight
fallocated 128 MiB files. (2) At the device, the engine's 1 MiB requests arrive whole or merged
(1.2-1.6 MiB on average, from /proc/diskstats), fio's arrive split (0.5-0.85 MiB): this virtio disk
takes at most 254 segments per request (``max_segments``), one 1 MiB buffer is 256 pages, and fio's
malloc'd buffers are not physically contiguous while the engine's long-lived bounce mmap mostly is;
the virtual disk serves bigger requests faster. (3) On a shared 2-core machine fio's single thread
can get less CPU than the engine's eight (``fio_psync`` controls for that). (4) This disk absorbs a
burst of writes fast and then throttles, so whoever writes first is faster; runs of ~1 s swing 2-4x,
and the old ratio was taken between medians of separate runs. Rotating the order, reading the same
files and reporting the request sizes make (1), (3) and (4) visible or equal; (2) is printed as a
NOTE, since no fio option controls the physical layout of its buffers. A ratio printed beside that
NOTE is not a clean one.

Setup: fio is a Debian package (``apt-get update && apt-get install -y fio``; 3.33 on bookworm).

    python benchmarks/swap_bandwidth.py --size-gib 4 --repeat 3            # under /tmp
    python benchmarks/swap_bandwidth.py --size-gib 8 --dir /local_nvme --json swap.json
"""
from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from zinf_runtime.swap import SwapConfig, SwapEngine

DIRECT_SHARE = 0.9  # a side whose block device moved less than this share of its payload used a cache


# ---------------------------------------------------------------------------------------------
# what the block device moved
# ---------------------------------------------------------------------------------------------

def block_device(path: str) -> Optional[str]:
    """The /proc/diskstats name of the block device holding ``path`` (None: tmpfs, overlay, ...)."""
    dev = os.stat(path).st_dev
    sysfs = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    try:
        real = os.path.realpath(sysfs)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    return os.path.basename(real)  # a partition has its own /proc/diskstats row, like a whole disk


def disk_counters(dev: Optional[str]) -> Tuple[int, int, int, int]:
    """(bytes read, bytes written, reads, writes) completed by ``dev`` so far (/proc/diskstats; 512-byte
    sectors). The request counts tell the IO size the device really saw, after splits and merges."""
    if dev is None:
        return (0, 0, 0, 0)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == dev:
                return int(fields[5]) * 512, int(fields[9]) * 512, int(fields[3]), int(fields[7])
    return (0, 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------

def phase(fn, dev: Optional[str]) -> Dict[str, float]:
    """Run ``fn`` (returns (payload bytes, seconds)); add what the block device moved meanwhile."""
    r0, w0, nr0, nw0 = disk_counters(dev)
    payload, seconds = fn()
    r1, w1, nr1, nw1 = disk_counters(dev)
    return {"payload": payload, "s": seconds, "gbps": payload / seconds / 1e9,
            "dev_read": r1 - r0, "dev_written": w1 - w0, "dev_reads": nr1 - nr0, "dev_writes": nw1 - nw0}


class Engine:
    """The engine side: ``n`` tensors of ``tbytes``, written to and read from one SwapEngine."""

    def __init__(self, args: argparse.Namespace, root: str, n: int, tbytes: int):
        self.n, self.tbytes = n, tbytes
        cfg = SwapConfig(root, block_size=args.block_kib << 10, queue_depth=args.queue_depth,
                         buffer_count=args.buffer_count, buffer_size=max(64 << 10, args.block_kib) << 10)

        def alloc() -> torch.Tensor:  # --aligned: page-aligned like pinned memory, so no bounce copy
            t = torch.frombuffer(mmap.mmap(-1, tbytes), dtype=torch.uint8) if args.aligned else \
                torch.empty(tbytes, dtype=torch.uint8)
            return t.zero_()  # pre-fault: training reuses long-lived buffers; first faults aren't disk time

        self.src = [alloc().random_(0, 256) for _ in range(min(n, 4))]
        self.outs = [alloc() for _ in range(n)]
        self.eng = SwapEngine(cfg)
        self.eng.write("warmup", self.src[0][: 8 << 20]).wait()  # threads started, bounce slots mapped
        self.version = 0

    def write(self) -> Tuple[int, float]:
        self.version += 1
        t0 = time.perf_counter()
        hs = [self.eng.write(f"t{i}", self.src[i % len(self.src)]) for i in range(self.n)]
        for h in hs:
            h.wait()
        return self.n * self.tbytes, time.perf_counter() - t0

    def read(self) -> Tuple[int, float]:
        for o in self.outs:
            o.zero_()  # a read that moved nothing cannot pass the check below
        t0 = time.perf_counter()
        hs = [self.eng.read(f"t{i}", self.outs[i]) for i in range(self.n)]
        for h in hs:
            h.wait()
        dt = time.perf_counter() - t0
        for i, o in enumerate(self.outs):
            if not torch.equal(o, self.src[i % len(self.src)]):
                raise RuntimeError(f"engine read back tensor {i} wrong")
        return self.n * self.tbytes, dt

    def files(self) -> List[str]:
        """The engine's files of the tensors, in the order they were written."""
        d = self.eng.stats()["dir"]
        by_name = {os.path.basename(p): p for p in glob.glob(os.path.join(d, "k_t*"))}
        out = [by_name.get(f"k_t{i}") for i in range(self.n)]
        if any(p is None for p in out):
            raise RuntimeError(f"engine files not found under {d}: {sorted(by_name)}")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.eng.close()


FIO_MODES = {
    # one submitting thread, the kernel keeps queue-depth requests in flight (the classic disk figure)
    "libaio": "libaio, 1 thread, iodepth = queue depth",
    # queue-depth threads each doing one blocking pread/pwrite at a time: the engine's own structure,
    # so the two sides also get the same share of a contended CPU
    "psync": "psync, queue-depth threads, 1 request each",
    # the disk's ceiling rather than the same IO: 4x the requests in flight
    "libaio_deep": "libaio, 1 thread, iodepth = 4 x queue depth (the disk's ceiling, not the same IO)",
}


def fio_job(args: argparse.Namespace, mode: str, rw: str, files: List[str], tbytes: int) -> List[str]:
    """fio arguments doing the engine's IO over ``files`` (each ``tbytes``): same IO size, same number of
    requests in flight, O_DIRECT, fallocated files (as the engine's ``posix_fallocate``)."""
    common = ["fio", "--output-format=json", "--group_reporting", f"--rw={rw}", f"--bs={args.block_kib}k",
              "--direct=1", f"--filesize={tbytes}", "--file_service_type=sequential", "--fallocate=posix",
              "--thread", "--unlink=0"]
    if mode in ("libaio", "libaio_deep"):
        depth = args.queue_depth * (4 if mode == "libaio_deep" else 1)
        return common + ["--ioengine=libaio", f"--iodepth={depth}", "--name=disk",
                         f"--filename={':'.join(files)}", f"--nrfiles={len(files)}"]
    jobs = []  # job j takes files j, j + qd, j + 2 qd, ... one after another
    for j in range(min(args.queue_depth, len(files))):
        mine = files[j::args.queue_depth]
        jobs += [f"--name=t{j}", f"--filename={':'.join(mine)}", f"--nrfiles={len(mine)}"]
    return common + ["--ioengine=psync", "--iodepth=1"] + jobs


def run_fio(cmd: List[str], rw: str) -> Tuple[int, float]:
    """(bytes, seconds) of a fio run; with several jobs, their aggregate (``group_reporting``)."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0][rw]
    if job["io_bytes"] <= 0 or job["runtime"] <= 0:
        raise RuntimeError(f"fio did no {rw} IO: {job}")
    return job["io_bytes"], job["runtime"] / 1e3  # runtime in ms


def foreign_share(busy0: float, own0: float, wall: float) -> float:
    """Share of all cores used by other processes since (busy0, own0), over ``wall`` seconds."""
    return max(0.0, (machine_busy_s() - busy0) - (process_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))


def machine_busy_s() -> float:
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def one_run(k: int, args: argparse.Namespace, root: str, dev: Optional[str], modes: List[str]) -> Dict[str, Any]:
    """One run: every side writes fresh files, then every side reads the engine's files. The order of
    the sides rotates from run to run, so no side always goes first (or always right after a write)."""
    tbytes = args.tensor_mib << 20
    n = max(1, round(args.size_gib * (1 << 30) / tbytes))
    eng = Engine(args, root, n, tbytes)
    dirs = {m: tempfile.mkdtemp(prefix=f"fio-{m}-{k}-", dir=root) for m in modes}
    order = ["engine"] + [f"fio_{m}" for m in modes]
    order = order[k % len(order):] + order[: k % len(order)]
    res: Dict[str, Any] = {"run": k, "order": order, "load1": os.getloadavg()[0]}
    busy0, own0, wall0 = machine_busy_s(), process_cpu_s(), time.perf_counter()
    try:
        for rw in ("write", "read"):
            for side in order:
                if side == "engine":
                    fn = eng.write if rw == "write" else eng.read
                else:
                    m = side[4:]
                    files = [os.path.join(dirs[m], f"f{i}") for i in range(n)] if rw == "write" else eng.files()
                    fn = (lambda cmd, rw: lambda: run_fio(cmd, rw))(fio_job(args, m, rw, files, tbytes), rw)
                res[f"{side}_{rw}"] = phase(fn, dev)
        st = eng.eng.stats()
        res["engine_direct_io"], res["engine_zero_copy_bytes"] = st["direct_io"], st["zero_copy_bytes"]
    finally:
        eng.close()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    res["other_cpu"] = foreign_share(busy0, own0, time.perf_counter() - wall0)
    res["load1_end"] = os.getloadavg()[0]
    return res


def request_kib(p: Dict[str, float], rw: str) -> float:
    """Mean size of the requests the device completed in the phase (KiB; 0 if none)."""
    n = p["dev_writes"] if rw == "write" else p["dev_reads"]
    return (p["dev_written"] if rw == "write" else p["dev_read"]) / 1024 / n if n else 0.0


def moved_share(p: Dict[str, float], rw: str) -> float:
    """Bytes the block device moved in the phase / payload (< 1: something below the disk served it)."""
    return (p["dev_written"] if rw == "write" else p["dev_read"]) / p["payload"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="volume each side writes and reads per run")
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir under /tmp)")
    ap.add_argument("--tensor-mib", type=int, default=128, help="size of each swapped tensor (= one file)")
    ap.add_argument("--block-kib", type=int, default=1024, help="IO size: engine block_size, fio bs (KiB)")
    ap.add_argument("--queue-depth", type=int, default=8, help="engine IO threads = fio requests in flight")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--aligned", action="store_true", help="page-aligned tensors (the engine's zero-copy path)")
    ap.add_argument("--fio-modes", default="libaio,psync,libaio_deep", help=f"fio references, of {list(FIO_MODES)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs (side order rotates); medians reported")
    ap.add_argument("--json", metavar="PATH", help="write every run here")
    args = ap.parse_args(argv)
    modes = [m for m in args.fio_modes.split(",") if m]
    bad = [m for m in modes if m not in FIO_MODES]
    if bad or not modes:
        ap.error(f"--fio-modes: unknown {bad}; choose from {list(FIO_MODES)}")

    fio_path = shutil.which("fio")
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() \
        if fio_path else None
    if not fio_path:
        print("=" * 78 + "\nfio NOT FOUND: there is no disk reference, so no engine/disk ratio is printed.\n"
              "Install it (Debian/Ubuntu: apt-get update && apt-get install -y fio) and rerun.\n" + "=" * 78,
              file=sys.stderr, flush=True)
        modes = []
    root = tempfile.mkdtemp(prefix="zinf-swapbench-", dir=args.dir or "/tmp")
    dev = block_device(root)
    if dev is None:
        print(f"WARNING: cannot map {root} to a block device in /proc/diskstats (tmpfs? overlay?): "
              f"O_DIRECT cannot be verified, so no ratio is printed", file=sys.stderr)
    sides = ["engine"] + [f"fio_{m}" for m in modes]
    runs = []
    try:
        for k in range(args.repeat):
            runs.append(one_run(k, args, root, dev, modes))
            r = runs[-1]
            line = "; ".join(f"{rw} " + " ".join(f"{s} {r[f'{s}_{rw}']['gbps']:.2f}" for s in sides)
                             for rw in ("write", "read"))
            print(f"  run {k} (order {', '.join(r['order'])}): {line} GB/s; load {r['load1']:.2f}->"
                  f"{r['load1_end']:.2f}, other CPU {r['other_cpu']:.0%}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    n = max(1, round(args.size_gib * (1 << 30) / (args.tensor_mib << 20)))
    print(f"\ndisk {dev} under {args.dir or '/tmp'}: {n} x {args.tensor_mib} MiB = {n * args.tensor_mib / 1024:g} GiB "
          f"per side per run, IO {args.block_kib} KiB, {args.queue_depth} in flight, aligned={args.aligned}, "
          f"engine O_DIRECT={all(r['engine_direct_io'] for r in runs)}; reference: "
          + (f"{fio_version} with O_DIRECT: " + "; ".join(f"fio_{m} = {FIO_MODES[m]}" for m in modes)
             if modes else "NONE (fio missing)"))
    print(f"{len(runs)} runs, load average {min(r['load1'] for r in runs):.2f}-{max(r['load1_end'] for r in runs):.2f} "
          f"on {os.cpu_count()} cores, other processes used up to {max(r['other_cpu'] for r in runs):.0%} of them")
    w = {s: max(12, len(s) + 2) for s in sides[1:]}  # column widths
    head = f"{'':7}{'engine':>8}" + "".join(f"{s:>{w[s]}}" for s in sides[1:]) + \
        (f"{'engine/best fio':>17}{'range':>12}" if modes else "") + "   device moved / payload, min"
    print(head + "\n" + " " * 7 + "(GB/s, median over runs)")
    ok = bool(modes) and dev is not None
    summary: Dict[str, Any] = {}
    for rw in ("write", "read"):
        med = {s: statistics.median(r[f"{s}_{rw}"]["gbps"] for r in runs) for s in sides}
        moved = {s: min(moved_share(r[f"{s}_{rw}"], rw) for r in runs) for s in sides}
        row: Dict[str, Any] = {"median_gbps": med, "runs_gbps": {s: [r[f"{s}_{rw}"]["gbps"] for r in runs]
                                                              for s in sides}, "min_moved_share": moved}
        cells = f"{rw:7}{med['engine']:8.3f}" + "".join(f"{med[s]:{w[s]}.3f}" for s in sides[1:])
        direct = dev is not None and all(v >= DIRECT_SHARE for v in moved.values())
        if modes and direct:
            ratios = [r[f"engine_{rw}"]["gbps"] / max(r[f"{s}_{rw}"]["gbps"] for s in sides[1:]) for r in runs]
            row["ratios"] = ratios
            row["ratio"] = statistics.median(ratios)
            cells += f"{row['ratio']:17.2f}{f'{min(ratios):.2f}-{max(ratios):.2f}':>12}"
        elif modes:
            ok = False
            cells += f"{'-':>17}{'-':>12}"
        moved_txt = ", ".join(f"{s} {v:.2f}" for s, v in moved.items()) if dev is not None else "unknown"
        print(cells + "   " + moved_txt + ("" if direct or not modes else "   NO RATIO: a side bypassed the disk"))
        req = {s: statistics.median(request_kib(r[f"{s}_{rw}"], rw) for r in runs) for s in sides}
        row["median_request_kib"] = req
        print(" " * 7 + "request size at the device (KiB, median): " + ", ".join(f"{s} {v:.0f}" for s, v in req.items()))
        if modes and any(abs(v - req["engine"]) > 0.1 * req["engine"] for v in req.values()):
            print(" " * 7 + "NOTE: the sides' requests reached the device at different sizes (split at the queue's "
                  "max_segments when a buffer's pages are not physically contiguous): they did not do the same IO")
        summary[rw] = row
    if modes:
        print("engine/best fio = median over runs of engine / (the faster fio reference of the same run); 1.0 = "
              "the engine keeps the disk as busy as fio can. device moved = /proc/diskstats bytes of the phase / "
              "payload (>= 0.9: the IO reached the device; O_DIRECT is not bypassed by the guest's page cache).")
    else:
        print("NO RATIO: fio is missing, so the engine's figures above are not compared with anything.")
    if any(r["other_cpu"] > 0.10 for r in runs):
        print("WARNING: other processes used >10% of the cores during some runs: these figures are contended")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "fio": fio_version, "device": dev, "summary": summary, "runs": runs},
                      fh, indent=1)
    return 0 if ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
