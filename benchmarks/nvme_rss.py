"""Host memory (RSS) of training a model whose states are >= 4 GiB with params and optimizer on NVMe.

ZeRO-Infinity's promise for ``offload_params="nvme"`` + ``offload_optimizer="nvme"`` is that host
memory stays a small fraction of the model states (fp32 params + grads + Adam's two moments = 16
bytes/param). This benchmark trains a GPT (default ~350M params, 5.3 GiB of states) for a few steps
in a FRESH subprocess (so imports, allocator state and peaks of this process do not leak in) and
reports:

* model-state bytes (16 x params) and the process peak RSS, their ratio (goal <= 0.35);
* the peak RSS of every phase (import, construct, trace, partition, compile, forward, backward,
  optimizer step), exact: at each phase boundary ``VmHWM`` is read and reset (``/proc/self/clear_refs``
  ``5``), so the peak of a phase is the kernel's own high-water mark, not a sample. ``ru_maxrss`` is
  read at the same points (a reset lowers it too, so the process peak is the max of those readings);
* a ``VmRSS`` timeline sampled by a thread, with the bytes of swap writes still in flight (their
  source tensors are alive until the write is done) and glibc's ``mallinfo2`` at phase ends (free
  bytes the allocator keeps instead of returning them);
* step times, losses, ``zinf_compile.memory_stats()`` and the swap engine's IO counters.

Allocator variants (``--variants``, each its own fresh process): ``base``; ``trim`` (``malloc_trim(0)``
at every phase end); ``arena2`` (``MALLOC_ARENA_MAX=2``); ``mmap`` (``MALLOC_MMAP_THRESHOLD_=1 MiB``:
every large tensor is its own mmap, returned to the OS when freed); ``mallopt`` (the same threshold
set in-process with ``mallopt`` after the imports, as a library could do). ``--build layerwise`` builds the
model on the meta device and materializes, initializes and partitions one module at a time (with the
exact placement the backend would use, so the backend finds the parameters already partitioned):
it shows what the peak would be if the backend did not need the whole model in memory at once.

    .venv/bin/python benchmarks/nvme_rss.py                # eager, ~353M params, variants base + mallopt
    .venv/bin/python benchmarks/nvme_rss.py --variants base,mmap --build layerwise --compiler inductor

The run fails loudly (exit status != 0) if the child fails; ``--json`` keeps every number, and
``--timeline`` adds the sampled (t, phase, VmRSS KiB, writes in flight) series.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple
from _procmem import reset_hwm as _reset_hwm  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
GOAL = 0.35
VARIANT_ENV: Dict[str, Dict[str, str]] = {
    "base": {},
    "trim": {},
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "mallopt": {},
}
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


# ------------------------------------------------------------------------------------------------
# /proc and glibc probes
# ------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0




class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def mallinfo() -> Dict[str, int]:
    """glibc heap numbers in bytes: heap (sbrk+arenas), mmapped, in use, free-but-kept."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return {"heap": mi.arena, "mmapped": mi.hblkhd, "in_use": mi.uordblks + mi.hblkhd, "free_kept": mi.fordblks}


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` at run time: what a library could do in-process."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes))


def malloc_trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def swap_writes_in_flight() -> int:
    """Bytes of swap writes submitted but not finished (their source tensors are still alive).

    Reads the engines' per-key newest request; a best-effort diagnostic, racy by design.
    """
    try:
        from zinf_runtime import tiers
        total = 0
        for eng in list(tiers._engines.values()):
            for h in list(eng._tail.values()):
                if h.kind == "write" and not h.done():
                    total += h.nbytes
        return total
    except Exception:  # noqa: BLE001 - never let the probe kill the benchmark
        return -1


# ------------------------------------------------------------------------------------------------
# phase tracking
# ------------------------------------------------------------------------------------------------
class PhaseMonitor:
    """Exact per-phase RSS peaks (VmHWM reset at boundaries) plus a sampled VmRSS timeline."""

    def __init__(self, interval_s: float, trim: bool) -> None:
        self.interval_s = interval_s
        self.trim = trim
        self.phase = "start"
        self.t_start = time.perf_counter()
        self.t_phase = self.t_start
        self.phases: List[Dict[str, Any]] = []
        self.samples: List[Tuple[float, str, int, int]] = []  # (t, phase, rss KiB, writes in flight B)
        self.hwm_reset_ok = _reset_hwm()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._cur = self._open_phase()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _open_phase(self) -> Dict[str, Any]:
        return {"phase": self.phase, "sampled_peak_kib": 0, "writes_in_flight_peak": 0}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = _status_kib("VmRSS")
            inflight = swap_writes_in_flight()
            cur = self._cur
            self.samples.append((time.perf_counter() - self.t_start, cur["phase"], rss, inflight))
            cur["sampled_peak_kib"] = max(cur["sampled_peak_kib"], rss)
            cur["writes_in_flight_peak"] = max(cur["writes_in_flight_peak"], inflight)

    def set_phase(self, name: str) -> None:
        """Close the current phase (record its exact peak) and open ``name``."""
        if name == self.phase:
            return
        now = time.perf_counter()
        cur = self._cur
        cur["hwm_kib"] = _status_kib("VmHWM")
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cur["ru_maxrss_kib"] = ru.ru_maxrss
        cur["minflt"], cur["sys_s"] = ru.ru_minflt - self._ru0.ru_minflt, ru.ru_stime - self._ru0.ru_stime
        self._ru0 = ru
        cur["end_rss_kib"] = _status_kib("VmRSS")
        cur["wall_s"] = now - self.t_phase
        cur["mallinfo"] = mallinfo()
        if self.trim:
            malloc_trim()
            cur["after_trim_rss_kib"] = _status_kib("VmRSS")
        self.phases.append(cur)
        self.phase, self.t_phase = name, time.perf_counter()
        self._cur = self._open_phase()
        _reset_hwm()

    def close(self) -> None:
        self.set_phase("end")
        self._stop.set()
        self._thread.join()

    def peak(self) -> Dict[str, Any]:
        return max(self.phases, key=lambda p: p["hwm_kib"])


# ------------------------------------------------------------------------------------------------
# the measured run (child process)
# ------------------------------------------------------------------------------------------------
def n_params(vocab: int, seq: int, layers: int, hidden: int) -> int:
    """Parameters of ``zinf_compile.models.GPT`` (tied head, no attention bias, MLP bias)."""
    return vocab * hidden + seq * hidden + layers * (12 * hidden * hidden + 9 * hidden) + 2 * hidden


def _options(args: argparse.Namespace, nvme_dir: str) -> Dict[str, Any]:
    return {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": nvme_dir,
            "compiler": args.compiler, "swap_buffer_size": args.swap_buffer_mib * MIB,
            "swap_buffer_count": args.swap_buffer_count, "swap_queue_depth": args.swap_queue_depth,
            "swap_block_size": args.swap_block_kib << 10,
            "optimizer_sub_group_bytes": args.sub_group_mib * MIB}


def _build_layerwise(cfg: Any, options: Dict[str, Any], partition: Callable) -> Any:
    """Meta-build the GPT, then materialize + init + partition one module at a time."""
    import torch
    import torch.nn as nn
    import zinf_runtime
    from zinf_compile.config import Config
    from zinf_compile.models import GPT

    c = Config.from_options(options)
    tier = {"none": "device", "cpu": "cpu", "nvme": "nvme"}
    placement = zinf_runtime.Placement(  # what zinf_compile.backend builds for CPU parameters
        tier=tier[c.offload_params], compute_device=torch.device("cpu"), group=c.resolved_group(),
        optim_tier=tier[c.offload_optimizer], swap=c.swap_config(), sub_group_bytes=c.optimizer_sub_group_bytes)
    with torch.device("meta"):
        model = GPT(cfg)
    named = [("tok", model.tok), ("pos", model.pos), *((f"blocks.{i}", b) for i, b in enumerate(model.blocks)),
             ("ln_f", model.ln_f)]
    for prefix, mod in named:
        mod.to_empty(device="cpu")
        for m in mod.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        if prefix == "tok":
            model.head.weight = model.tok.weight  # to_empty made a new Parameter: tie again
        partition([(f"{prefix}.{n}", p) for n, p in mod.named_parameters()], placement, c.sync_module_states)
    bad = [n for n, p in model.named_parameters() if p.is_meta]
    assert not bad, f"left on meta: {bad}"
    return model


def child(args: argparse.Namespace, result_path: str) -> None:
    mon = PhaseMonitor(args.sample_ms / 1000, trim=args.variant == "trim")
    mon.set_phase("import")
    import torch
    import zinf_compile
    import zinf_compile.backend as zbackend
    import zinf_runtime
    from zinf_compile.models import GPT, GPTConfig, make_batch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    nvme_dir = tempfile.mkdtemp(prefix="zinf-nvme-rss-", dir=args.dir)
    options = _options(args, nvme_dir)
    step = {"i": 0}

    # instrumentation only: phase markers around the backend's partition and compile
    orig_partition, orig_compile = zinf_runtime.partition, zbackend.compile_graph

    def partition(*a: Any, **k: Any) -> Any:
        mon.set_phase("partition")
        try:
            return orig_partition(*a, **k)
        finally:
            mon.set_phase("compile")

    def compile_graph(*a: Any, **k: Any) -> Callable:
        compiled = orig_compile(*a, **k)

        def run(*xs: Any) -> Any:
            mon.set_phase(f"step{step['i']}.forward")
            return compiled(*xs)

        if hasattr(compiled, "_boxed_call"):
            run._boxed_call = compiled._boxed_call  # type: ignore[attr-defined]
        return run

    zinf_runtime.partition, zbackend.compile_graph = partition, compile_graph

    mon.set_phase("construct")
    if args.variant == "mallopt":
        assert set_mmap_threshold(1 << 20), "mallopt(M_MMAP_THRESHOLD) refused"
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden,
                    heads=max(1, args.hidden // 64))
    torch.manual_seed(0)
    model = _build_layerwise(cfg, options, orig_partition) if args.build == "layerwise" else GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 16 * params
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    losses: List[float] = []
    steps: List[Dict[str, float]] = []
    for i in range(args.steps):
        step["i"] = i
        x, y = make_batch(cfg, 1, seed=i)
        t0 = time.perf_counter()
        mon.set_phase("trace" if i == 0 else f"step{i}.forward")
        loss = cmodel(x, y)
        t1 = time.perf_counter()
        mon.set_phase(f"step{i}.backward")
        loss.backward()
        t2 = time.perf_counter()
        mon.set_phase(f"step{i}.optimizer")
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        losses.append(loss.detach().item())
        steps.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "total_s": t3 - t0})
        print(f"[child] step {i}: loss {losses[-1]:.4f}  {t3 - t0:.1f}s  rss {_status_kib('VmRSS') / 1024:.0f} MiB",
              flush=True)
    mon.set_phase("after")
    engines = {}
    try:
        from zinf_runtime import tiers
        engines = {str(i): {k: v for k, v in e.stats().items() if k != "dir"} for i, e in
                   enumerate(tiers._engines.values())}
    except Exception as e:  # noqa: BLE001
        engines = {"error": repr(e)}
    stats = zinf_compile.memory_stats()
    mon.close()
    shutil.rmtree(nvme_dir, ignore_errors=True)
    peak_kib = max(p["ru_maxrss_kib"] for p in mon.phases)
    out = {
        "variant": args.variant, "build": args.build, "compiler": args.compiler, "params": params,
        "state_bytes": state_bytes, "peak_rss_bytes": peak_kib * 1024, "ratio": peak_kib * 1024 / state_bytes,
        "peak_phase": mon.peak()["phase"], "hwm_reset_ok": mon.hwm_reset_ok, "phases": mon.phases,
        "losses": losses, "steps": steps, "memory_stats": stats, "swap": engines, "options": options,
        "env": {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_") if k in os.environ},
        "gpt": {"vocab": cfg.vocab, "seq": cfg.seq, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads},
    }
    if args.timeline:
        out["timeline"] = mon.samples
    with open(result_path, "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------------------------------
# driver (parent process) and report
# ------------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / MIB:,.0f}"


def report(r: Dict[str, Any]) -> str:
    sb = r["state_bytes"]
    lines = [
        f"== variant {r['variant']}  build {r['build']}  compiler {r['compiler']}  env {r['env'] or '{}'}",
        f"GPT {r['gpt']}: {r['params'] / 1e6:.1f}M params; model states (16 B/param) {sb / GIB:.2f} GiB",
        f"peak RSS {r['peak_rss_bytes'] / GIB:.3f} GiB (ru_maxrss, max over phases) = {r['ratio']:.3f} x model "
        f"states (goal <= {GOAL}: {'MET' if r['ratio'] <= GOAL else 'MISSED'}); peak in phase '{r['peak_phase']}'",
        "" if r["hwm_reset_ok"] else "WARNING: /proc/self/clear_refs refused: phase peaks are cumulative",
        f"{'phase':<18}{'wall s':>8}{'peak MiB':>10}{'sampled':>9}{'end MiB':>9}{'peak/st':>8}"
        f"{'wr-flight':>10}{'heap':>8}{'mmapd':>8}{'in use':>8}{'freekept':>9}{'minflt':>8}{'sys s':>7}"
        + (f"{'trimmed':>9}" if r["variant"] == "trim" else ""),
    ]
    for p in r["phases"]:
        if p["phase"] == "start":
            continue
        mi = p.get("mallinfo") or {}
        lines.append(
            f"{p['phase']:<18}{p['wall_s']:>8.2f}{p['hwm_kib'] / 1024:>10,.0f}{p['sampled_peak_kib'] / 1024:>9,.0f}"
            f"{p['end_rss_kib'] / 1024:>9,.0f}{p['hwm_kib'] * 1024 / sb:>8.3f}"
            f"{_mib(max(p['writes_in_flight_peak'], 0)):>10}"
            + "".join(f"{_mib(mi.get(k, 0)):>8}" for k in ("heap", "mmapped", "in_use"))
            + f"{_mib(mi.get('free_kept', 0)):>9}{p['minflt'] / 1000:>7,.0f}k{p['sys_s']:>7.1f}"
            + (f"{p.get('after_trim_rss_kib', 0) / 1024:>9,.0f}" if r["variant"] == "trim" else ""))
    lines.append("(MiB; peak = VmHWM of the phase; sampled = max sampled VmRSS; wr-flight = peak swap-write bytes "
                 "in flight; heap/mmapd/in use/freekept = glibc mallinfo2 at phase end; minflt = minor page faults, "
                 "sys s = kernel CPU seconds in the phase)")
    lines.append("")
    for i, (s, loss) in enumerate(zip(r["steps"], r["losses"])):
        lines.append(f"step {i}: loss {loss:.4f}  total {s['total_s']:.2f}s  (forward {s['forward_s']:.2f}s incl. "
                     f"compile on step 0, backward {s['backward_s']:.2f}s, optimizer {s['optimizer_s']:.2f}s)")
    lines.append("memory_stats (GiB, current/peak):")
    for tier, kinds in r["memory_stats"].items():
        row = [f"{k} {v['current'] / GIB:.2f}/{v['peak'] / GIB:.2f}" for k, v in kinds.items() if v["peak"]]
        lines.append(f"  {tier:<7}" + ("  ".join(row) if row else "-"))
    for name, s in r["swap"].items():
        if isinstance(s, dict):
            lines.append(f"swap engine {name}: written {s.get('bytes_written', 0) / GIB:.2f} GiB, read "
                         f"{s.get('bytes_read', 0) / GIB:.2f} GiB, peak disk {s.get('peak_disk_bytes', 0) / GIB:.2f} "
                         f"GiB, busy {s.get('busy_s', 0):.1f}s, direct_io {s.get('direct_io')}")
    return "\n".join(lines)


def run_variant(args: argparse.Namespace, variant: str, argv: List[str]) -> Dict[str, Any]:
    env = dict(os.environ, **VARIANT_ENV[variant])
    fd, path = tempfile.mkstemp(prefix="nvme_rss-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--variant", variant, "--_child", path]
    print(f"$ {' '.join(f'{k}={v}' for k, v in VARIANT_ENV[variant].items())} {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, env=env, check=True)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="swap folder root (a temp folder is made inside)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--build", default="plain", choices=["plain", "layerwise"],
                    help="plain: GPT(cfg) then compile; layerwise: meta-build, materialize+partition per module")
    ap.add_argument("--swap-buffer-mib", type=int, default=8)
    ap.add_argument("--swap-buffer-count", type=int, default=2)
    ap.add_argument("--swap-queue-depth", type=int, default=8)
    ap.add_argument("--swap-block-kib", type=int, default=1024)
    ap.add_argument("--sub-group-mib", type=int, default=64, help="optimizer_sub_group_bytes in MiB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--sample-ms", type=float, default=5.0, help="VmRSS sampling period")
    ap.add_argument("--variants", default="base,mallopt", help=f"comma list of {sorted(VARIANT_ENV)}")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--timeline", action="store_true", help="keep the sampled VmRSS timeline in --json")
    ap.add_argument("--min-params", type=int, default=268_435_456, help="refuse smaller models (4 GiB of states)")
    ap.add_argument("--variant", default="base", help=argparse.SUPPRESS)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(args, args._child)
        return

    n = n_params(args.vocab, args.seq, args.layers, args.hidden)
    if n < args.min_params:
        sys.exit(f"model has {n / 1e6:.0f}M params ({16 * n / GIB:.2f} GiB of states) < --min-params "
                 f"{args.min_params / 1e6:.0f}M; raise --layers/--hidden")
    need = int(16 * n * 1.3)  # states on disk + versions being rewritten
    free = shutil.disk_usage(args.dir).free
    if free < need:
        sys.exit(f"{args.dir}: {free / GIB:.1f} GiB free, need ~{need / GIB:.1f} GiB")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANT_ENV:
            sys.exit(f"unknown variant {v!r}; choose from {sorted(VARIANT_ENV)}")
    argv = [a for a in sys.argv[1:]]
    drop = {"--variants", "--json"}
    argv = [a for i, a in enumerate(argv) if a not in drop and (i == 0 or argv[i - 1] not in drop)
            and not a.startswith(("--variants=", "--json="))]
    print(f"{n / 1e6:.1f}M params, {16 * n / GIB:.2f} GiB of model states; {free / GIB:.0f} GiB free in {args.dir}")
    results = []
    for v in variants:
        r = run_variant(args, v, argv)
        print(report(r), flush=True)
        results.append(r)
    if len(results) > 1:
        print("\nsummary: " + "; ".join(
            f"{r['variant']}: peak {r['peak_rss_bytes'] / GIB:.2f} GiB = {r['ratio']:.3f} ({r['peak_phase']}), "
            "steps after the first " + ", ".join(f"{s['total_s']:.1f}s" for s in r["steps"][1:]) for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
