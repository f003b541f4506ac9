"""Memory-centric tiling of one linear layer: working memory and step time against the tile count.

Why: ZeRO-Infinity's memory-centric tiling splits a large matmul into T tiles along its output
dimension and fetches / releases each tile on its own, in forward and in backward, so the parameter +
gradient working memory of the operator drops to about 1/T of the untiled one, while the step time
should barely move. The goals checked here (reported as PASS / MISS, never asserted):

    working-memory ratio  peak materialized(T) / peak materialized(T=1)  <= 1/T + 0.05
    step-time ratio       median step(T) / median step(T=1)               <= 1.15   (for T <= 8)

Each row is one ``nn.Linear(hd, 4*hd)`` (fp32, no bias unless ``--bias``) compiled with
``backend="zinf"`` and options ``{"compiler": ..., "tiles": T, "tile_threshold_bytes": 0}`` (T = 1:
untiled), trained with ``zinf_compile.optim.AdamW`` on a ``--batch`` x hd input (loss: mean of the
squared output). The first step (compilation included) is a warm-up; then the peak memory stats are
reset and ``--steps`` steps are timed (median reported). Every row runs in a fresh subprocess (this
file, ``--row HD T``), so the process peak RSS, the compile caches and the process-wide memory
counters belong to that row alone.

Reported per row, and what each figure is:

* ``acct. mat.``: the runtime's own **accounting** (``memory_stats()["device"]["materialized"]["peak"]``):
  the bytes of gathered parameters + live full gradients the zinf ops registered. It is bookkeeping
  of the tensors zinf creates, not a measurement of memory; it is deterministic.
* ``RSS step``: a **measurement**: the process's resident-set high-water mark (``VmHWM`` from
  /proc/self/status, reset through /proc/self/clear_refs before the timed steps) minus the resident
  set when the timed steps start. It is what the steps really added to the process, activations,
  allocator slack and page-cache-free heap included. ``RSS peak`` is the high-water mark of the
  whole process (torch itself, compile included), per phase in the JSON (``rss`` field).
* ``step``: the median wall time of a whole training step: forward, backward, the AdamW step over
  every tile, ``zero_grad``, the loss, plus every per-tile fetch / release / reduce_grad and what the
  allocator does for them. It is **not** a measurement of the tile loop alone; ``--profile`` adds one
  ``torch.profiler`` step per row that splits the step's time into zinf ops, matmuls, other ops and
  untracked (Python) time.
* ``other`` / ``load``: the share of all cores used by other processes while timing, and the 1-min
  load average: a timing with ``other`` above a few percent is a contended timing.

With ``--repeat R`` every row runs R times (round-robin) and the run with the smallest median step is
kept (accounting is deterministic; RSS and time are reported from that same run).

On CPU, glibc serves every allocation over 32 MiB with a fresh ``mmap`` (page-faulted and zeroed on
first touch) and unmaps it on free, so an untiled weight or gradient of 64-256 MiB pays that cost
on every fetch, while tiles of <= 32 MiB are recycled from the heap: tiled rows can then look
*faster* than T = 1. ``--glibc-no-mmap`` runs the rows with ``MALLOC_MMAP_MAX_=0`` and a huge
``MALLOC_TRIM_THRESHOLD_`` (everything from the heap, nothing returned to the OS), which removes
that artifact (a GPU's caching allocator behaves like this). Freed memory then stays resident, so
under ``--glibc-no-mmap`` (= ``--malloc heap``) the RSS columns show the heap's high-water mark, not
the working set. ``--malloc mmap`` does the opposite: a fixed 64 KiB mmap threshold, so every tensor
buffer is its own mapping, unmapped when freed, and ``RSS step`` follows the live tensors (to the
page); it adds an mmap + page faults to every allocation, so its step times are not the clean ones.
The memory figures of the README come from ``--malloc mmap``, the step times from ``--malloc heap``.

    python benchmarks/tiling.py                                  # hd {1024,2048,4096} x T {1,2,4,8,16}
    python benchmarks/tiling.py --repeat 3 --glibc-no-mmap       # step ratios without the mmap artifact
    python benchmarks/tiling.py --malloc mmap                    # RSS columns that follow the live tensors
    python benchmarks/tiling.py --hd 2048 --tiles 1,4 --profile  # where a step's time goes
    python benchmarks/tiling.py --hd 1024 --tiles 1,4 --compiler inductor --json /tmp/tiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional
from _procmem import reset_hwm  # noqa: E402

MALLOC_ENV: Dict[str, Dict[str, str]] = {
    "default": {},
    # everything from the heap, nothing returned: no mmap + page-fault cost per large allocation
    "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    # every block >= 64 KiB is its own mmap, unmapped on free: resident memory follows the live tensors
    "mmap": {"MALLOC_MMAP_THRESHOLD_": str(64 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)},
}
MEM_SLACK = 0.05  # working-memory ratio goal: <= 1/T + MEM_SLACK
STEP_GOAL = 1.15  # step-time ratio goal, checked for T <= STEP_GOAL_MAX_T
STEP_GOAL_MAX_T = 8


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine so far, all cores (from /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s() -> float:
    """CPU seconds used by this process (all threads) and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rss_kib() -> Dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak since the last :func:`reset_hwm`) of this process, in KiB."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in out:
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out




def profile_step(step, i: int) -> Dict[str, float]:
    """One step under ``torch.profiler``: its wall ms, split into the self CPU time of zinf ops,
    matmuls, other ops, and the untracked rest (Python, dispatch outside ops, profiler overhead)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step(i)
        wall_ms = (time.perf_counter() - t0) * 1e3
    zinf = mm = other = 0.0
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3
        if ev.key.startswith("zinf::"):
            zinf += ms
        elif ev.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            mm += ms
        else:
            other += ms
    return {"wall_ms": wall_ms, "zinf_ops_ms": zinf, "matmul_ms": mm, "other_ops_ms": other,
            "untracked_ms": max(0.0, wall_ms - zinf - mm - other)}


# ---------------------------------------------------------------------------------------------
# one row (subprocess)
# ---------------------------------------------------------------------------------------------

def run_row(hd: int, tiles: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Build, compile and time one ``Linear(hd, 4*hd)`` with ``tiles`` tiles; return the measurements."""
    import torch

    import zinf_compile

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = torch.nn.Linear(hd, 4 * hd, bias=args.bias)
    weight_bytes = layer.weight.numel() * layer.weight.element_size()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(args.batch, hd, generator=g) for _ in range(2)]
    with torch.no_grad():  # reference output of the untouched layer (compiled forward must match)
        reference = layer(inputs[0])

    options = {"compiler": args.compiler, "tiles": tiles, "tile_threshold_bytes": 0}
    model = torch.compile(layer, backend="zinf", options=options)
    opt = zinf_compile.optim.AdamW(layer.parameters(), lr=1e-4)

    def step(i: int) -> tuple[float, Optional[torch.Tensor]]:
        opt.zero_grad(set_to_none=True)
        y = model(inputs[i % len(inputs)])
        loss = y.pow(2).mean()
        loss.backward()
        opt.step()
        return float(loss.detach()), y.detach()

    hwm_ok = reset_hwm()
    rss = {"setup": rss_kib()}  # torch, the layer and its inputs
    t0 = time.perf_counter()
    first_loss, first_out = step(0)
    first_s = time.perf_counter() - t0
    rss["first_step"] = rss_kib()  # compile + first step (VmHWM: their peak)
    out_err = float((first_out - reference).abs().max())
    del first_out

    zinf_compile.reset_peak_memory_stats()
    reset_hwm()
    rss["steps_start"] = rss_kib()
    times: List[float] = []
    losses = [first_loss]
    busy0, own0, wall0 = machine_busy_s(), process_cpu_s(), time.perf_counter()
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss, _ = step(i)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    wall = time.perf_counter() - wall0
    foreign = max(0.0, (machine_busy_s() - busy0) - (process_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
    rss["steps"] = rss_kib()  # VmHWM: the peak over the timed steps only

    dev = zinf_compile.memory_stats()["device"]
    prof = profile_step(step, args.steps + 1) if args.profile else None
    counters: Dict[str, int] = {}
    for rec in zinf_compile.compile_records():
        for k, v in rec.counters.items():
            counters[k] = counters.get(k, 0) + int(v)
    return {
        "hd": hd, "tiles": tiles, "compiler": args.compiler, "bias": args.bias, "batch": args.batch,
        "weight_bytes": weight_bytes,
        "peak_materialized": dev["materialized"]["peak"], "peak_gathered": dev["gathered"]["peak"],
        "peak_grad_buffer": dev["grad_buffer"]["peak"],
        "optim_bytes": dev["optim"]["current"], "param_shard_bytes": dev["param"]["current"],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
        "rss": rss, "rss_phases_measured": hwm_ok,
        # what the timed steps added to the resident set (measured, not accounted)
        "step_rss_kib": rss["steps"]["VmHWM"] - rss["steps_start"]["VmRSS"] if hwm_ok else None,
        "profile": prof,
        "first_step_s": first_s, "median_step_s": statistics.median(times), "min_step_s": min(times),
        "step_times_s": times, "losses": losses, "first_out_max_abs_err": out_err,
        "foreign_cpu": foreign, "loadavg": os.getloadavg(), "threads": torch.get_num_threads(),
        "tiles_planned": counters.get("tiles_planned", 0), "counters": counters, "torch": torch.__version__,
        "zinf_compile_file": zinf_compile.__file__,
    }


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def spawn(hd: int, tiles: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Run one row in a fresh interpreter; on failure return a record with the error."""
    fd, out = tempfile.mkstemp(prefix=f"tiling-{hd}-{tiles}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--row", str(hd), str(tiles), "--json-out", out,
           "--compiler", args.compiler, "--batch", str(args.batch), "--steps", str(args.steps),
           "--threads", str(args.threads)] + (["--bias"] if args.bias else []) + \
        (["--profile"] if args.profile else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.update(MALLOC_ENV[args.malloc])
    if args.inductor_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"timeout after {args.timeout} s"
    try:
        if rc == 0:
            with open(out) as f:
                res = json.load(f)
        else:
            res = {"hd": hd, "tiles": tiles, "error": f"exit code {rc}: {tail}"}
    finally:
        os.unlink(out)
    res["process_s"] = time.perf_counter() - t0
    if "error" in res:
        print(f"  hd={hd:<5} T={tiles:<3} FAILED ({res['error'][-300:]})", flush=True)
    else:
        step_rss = res["step_rss_kib"]
        print(f"  hd={hd:<5} T={tiles:<3} acct. materialized {res['peak_materialized'] / 2**20:8.2f} MiB, "
              f"RSS added by the steps {'?' if step_rss is None else f'{step_rss / 1024:.1f}'} MiB, "
              f"median {res['median_step_s'] * 1e3:8.1f} ms, first {res['first_step_s']:.2f} s, "
              f"peak RSS {res['peak_rss_kib'] / 1024:.0f} MiB, other CPU {res['foreign_cpu']:.0%}, "
              f"load {res['loadavg'][0]:.2f}", flush=True)
    return res


def best(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row out of repeated runs: the one with the smallest median step (its RSS and times are
    reported together); the accounting is deterministic, so its peaks are the max over runs."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out = dict(min(ok, key=lambda r: r["median_step_s"]))
    for key in ("peak_materialized", "peak_gathered", "peak_grad_buffer"):
        out[key] = max(r[key] for r in ok)
    out["runs"] = len(ok)
    out["median_step_s_all_runs"] = [r["median_step_s"] for r in ok]
    out["step_rss_kib_all_runs"] = [r["step_rss_kib"] for r in ok]
    return out


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Ratios against the T = 1 row of the same hd, and PASS / MISS marks for the two goals."""
    base = {r["hd"]: r for r in rows if r["tiles"] == 1 and "error" not in r}
    for r in rows:
        b = base.get(r["hd"])
        if "error" in r or b is None:
            continue
        t = r["tiles"]
        r["mem_ratio"] = r["peak_materialized"] / b["peak_materialized"] if b["peak_materialized"] else float("nan")
        r["mem_goal"] = 1.0 / t + MEM_SLACK
        r["rss_ratio"] = r["step_rss_kib"] / b["step_rss_kib"] if r["step_rss_kib"] and b["step_rss_kib"] \
            else float("nan")
        r["step_ratio"] = r["median_step_s"] / b["median_step_s"]
        r["min_step_ratio"] = r["min_step_s"] / b["min_step_s"]
        r["mem_mark"] = "-" if t == 1 else ("PASS" if r["mem_ratio"] <= r["mem_goal"] else "MISS")
        r["step_mark"] = "-" if t == 1 or t > STEP_GOAL_MAX_T else ("PASS" if r["step_ratio"] <= STEP_GOAL else "MISS")


def table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'hd':>5} {'T':>3} {'weight MiB':>10} {'acct.mat MiB':>12} {'acct x':>6} {'goal':>5} {'':>4} "
            f"{'RSS step MiB':>12} {'RSS x':>6} {'RSS peak':>8} {'first s':>8} {'median ms':>10} {'step x':>7} "
            f"{'':>4} {'min x':>6} {'other':>6} {'load':>5} {'loss[-1]':>10}")
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['hd']:>5} {r['tiles']:>3}  FAILED: {r['error'][:200]}")
            continue
        mib = 2.0**20
        step_rss = r["step_rss_kib"] / 1024 if r["step_rss_kib"] is not None else nan
        lines.append(
            f"{r['hd']:>5} {r['tiles']:>3} {r['weight_bytes'] / mib:>10.1f} {r['peak_materialized'] / mib:>12.2f} "
            f"{r.get('mem_ratio', nan):>6.3f} {r.get('mem_goal', nan):>5.3f} {r.get('mem_mark', '?'):>4} "
            f"{step_rss:>12.1f} {r.get('rss_ratio', nan):>6.3f} {r['peak_rss_kib'] / 1024:>8.0f} "
            f"{r['first_step_s']:>8.2f} {r['median_step_s'] * 1e3:>10.1f} {r.get('step_ratio', nan):>7.2f} "
            f"{r.get('step_mark', '?'):>4} {r.get('min_step_ratio', nan):>6.2f} "
            f"{r['foreign_cpu']:>6.0%} {r['loadavg'][0]:>5.2f} {r['losses'][-1]:>10.6f}")
    lines += [
        f"goals: acct x = accounted materialized(T)/(T=1) <= 1/T + {MEM_SLACK}; "
        f"step x = median step(T)/median step(T=1) <= {STEP_GOAL} for T <= {STEP_GOAL_MAX_T}",
        "acct.mat = ACCOUNTING, not a measurement: peak of the runtime's memory_stats()['device']['materialized'] "
        "(gathered params + live full gradients, as zinf registers them). RSS step = MEASURED: VmHWM over the timed "
        "steps minus VmRSS when they start (what the steps added to the resident set: activations, allocator slack "
        "and heap included); RSS x = RSS step(T)/RSS step(T=1). RSS peak = process peak resident set (MiB, torch "
        "and compile included). step = median whole training step (forward, backward, AdamW over every tile, "
        "zinf's per-tile ops, allocator): not the tile loop alone (--profile splits it). min x = fastest "
        "step(T)/fastest step(T=1). other = share of all cores used by other processes while timing; load = "
        "1-min load average at the end of the row",
    ]
    profiled = [r for r in rows if "error" not in r and r.get("profile")]
    if profiled:
        lines.append("profile of one step (torch.profiler, self CPU ms): hd T: wall = zinf ops + matmul + "
                     "other ops + untracked")
        for r in profiled:
            p = r["profile"]
            lines.append(f"  {r['hd']:>5} {r['tiles']:>3}: {p['wall_ms']:8.1f} = {p['zinf_ops_ms']:7.1f} + "
                         f"{p['matmul_ms']:7.1f} + {p['other_ops_ms']:7.1f} + {p['untracked_ms']:7.1f}")
    if any("error" not in r and not r.get("rss_phases_measured", True) for r in rows):
        lines.append("WARNING: /proc/self/clear_refs unavailable: RSS step could not be measured per phase")
    noisy = [f"{r['hd']}/T{r['tiles']}" for r in rows if "error" not in r and r["foreign_cpu"] > 0.10]
    if noisy:
        lines.append(f"WARNING: other processes used >10% of the cores while timing {noisy}: these step times "
                     f"are contended")
    errs = [r for r in rows if "error" not in r and r["first_out_max_abs_err"] > 1e-3]
    if errs:
        lines.append(f"WARNING: compiled output differs from eager in {[(r['hd'], r['tiles']) for r in errs]}")
    files = sorted({r["zinf_compile_file"] for r in rows if r.get("zinf_compile_file")})
    lines.append(f"zinf_compile imported from: {', '.join(files) or '?'}")
    return "\n".join(lines)


def int_list(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hd", type=int_list, default=[1024, 2048, 4096], help="comma-separated hidden sizes")
    p.add_argument("--tiles", type=int_list, default=[1, 2, 4, 8, 16], help="comma-separated tile counts")
    p.add_argument("--compiler", choices=("eager", "inductor"), default="eager", help="zinf option 'compiler'")
    p.add_argument("--batch", type=int, default=8, help="rows of the input (batch x hd)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up step (median reported)")
    p.add_argument("--repeat", type=int, default=1, help="run every row R times (round-robin), keep the fastest")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per row (default 1: steadier timings on a shared machine)")
    p.add_argument("--bias", action="store_true", help="give the layer a bias (not tiled: 1-D, gathered whole)")
    p.add_argument("--malloc", choices=tuple(MALLOC_ENV), default="default",
                   help="glibc allocator of the rows: default; heap (MALLOC_MMAP_MAX_=0, no trim: no per-fetch "
                        "mmap cost, RSS = heap high-water); mmap (fixed 64 KiB mmap threshold, trim at once: RSS "
                        "follows the live tensors, for the memory columns)")
    p.add_argument("--glibc-no-mmap", dest="malloc", action="store_const", const="heap", help="= --malloc heap")
    p.add_argument("--profile", action="store_true",
                   help="profile one more step per row (torch.profiler): zinf ops / matmul / other / untracked")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per row process")
    p.add_argument("--inductor-cache", default=None, help="TORCHINDUCTOR_CACHE_DIR for the rows (default: inherit)")
    p.add_argument("--json", metavar="PATH", help="write all rows (and every run) here")
    p.add_argument("--row", type=int, nargs=2, metavar=("HD", "T"), help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.row:
        res = run_row(args.row[0], args.row[1], args)
        with open(args.json_out, "w") as f:
            json.dump(res, f)
        return

    if 1 not in args.tiles:
        print("note: no T=1 row requested; ratios need it, adding T=1", flush=True)
        args.tiles = [1] + args.tiles
    print(f"Linear(hd, 4*hd), fp32, bias={args.bias}, batch {args.batch}, compiler {args.compiler!r}, "
          f"{args.steps} timed steps, {args.threads} thread(s), repeat {args.repeat}, "
          f"malloc {args.malloc} {MALLOC_ENV[args.malloc] or ''}; "
          f"load at start {os.getloadavg()[0]:.2f}", flush=True)
    runs: List[Dict[str, Any]] = []
    for rep in range(args.repeat):
        for hd in args.hd:
            for t in args.tiles:
                runs.append(spawn(hd, t, args))
    rows = [best([r for r in runs if (r["hd"], r["tiles"]) == (hd, t)]) for hd in args.hd for t in args.tiles]
    add_ratios(rows)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("row", "json_out")},
                       "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
