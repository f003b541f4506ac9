"""Largest trainable hidden size under a fixed device memory budget, without and with tiling.

Why: the ZeRO-Infinity paper (figure 6b) shows that memory-centric tiling lets a fixed amount of
device memory train much wider layers: without tiling, a single operator's parameters + gradients
must fit on the device at once, so the hidden size is capped by the budget; with tiling, each matmul
is split into tiles that fit, and the cap moves to whatever holds the model states (here: host RAM).

This script reproduces that on CPU. The zinf runtime emulates the device limit with
``device_memory_budget`` (``--budget-mib``, default 256 MiB): it raises ``ZinfOutOfMemoryError``
instead of materializing parameters / gradients beyond it. For each hidden size hd (ascending) it
runs ONE training step (zero_grad, forward, backward, ``zinf_compile.optim.AdamW`` step) of a
``--layers``-layer GPT (``GPTConfig(vocab=256, seq=16, layers=2, hidden=hd, heads=hd // 64)``,
batch 1) compiled with ``backend="zinf"`` in two modes (``tiles: 1`` is needed for "untiled": a huge
``tile_threshold_bytes`` alone still lets the budget force tiles):

    untiled  {"compiler": "eager", "device_memory_budget": B, "tile_threshold_bytes": 2**62, "tiles": 1}
    tiled    {"compiler": "eager", "device_memory_budget": B}   (tile counts chosen from the budget)

Each attempt runs in a fresh subprocess with a timeout (``--timeout``) and a host-memory guard (the
child exits cleanly if the machine's MemAvailable drops under ``--guard-gib``, so the kernel's OOM
killer never has to pick a victim). A mode stops at its first failing size. Sizes whose model
states would not fit in host RAM are skipped without running: the states cost about 16 bytes per
parameter (fp32 shard + fp32 gradient + two Adam moments), with ``12 * layers * hd**2 + vocab * hd``
parameters; a size is skipped when that exceeds ``--host-limit-gib`` (default 14) or 85% of the
MemAvailable measured just before the attempt.

The embeddings and LayerNorms are not tiled (they are not matmul weights; the LM head is tied to the
token embedding, so that weight is not tiled either); with vocab 256 they are small.

    python benchmarks/hidden_scaling.py                               # default sizes, 256 MiB budget
    python benchmarks/hidden_scaling.py --sizes 1024,2048 --modes tiled --json /tmp/hs.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

DEFAULT_SIZES = "1024,1536,2048,2560,3072,4096,5120,6144,8192"
MODES = ("untiled", "tiled")
BYTES_PER_PARAM = 16  # fp32 master shard + fp32 gradient shard + Adam exp_avg + exp_avg_sq
GIB = 2**30
MIB = 2**20


def mem_available() -> int:
    """The machine's MemAvailable in bytes (Linux); a large number where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def approx_params(hd: int, layers: int, vocab: int) -> int:
    """The estimate used for the host-RAM check: ``12 * layers * hd**2 + vocab * hd``."""
    return 12 * layers * hd * hd + vocab * hd


def exact_params(hd: int, layers: int, vocab: int, seq: int) -> int:
    """Parameters of ``zinf_compile.models.GPT`` (mlp bias on, attention bias off, head tied)."""
    block = 3 * hd * hd + hd * hd + (4 * hd * hd + 4 * hd) + (4 * hd * hd + hd) + 4 * hd
    return layers * block + vocab * hd + seq * hd + 2 * hd


def causes(e: BaseException) -> List[BaseException]:
    """``e`` and the exceptions it was raised from / during, outermost first."""
    out: List[BaseException] = []
    cur: Optional[BaseException] = e
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def options_for(mode: str, budget: int) -> Dict[str, Any]:
    opts: Dict[str, Any] = {"compiler": "eager", "device_memory_budget": budget}
    if mode == "untiled":
        # the threshold alone does not disable tiling: with a budget, plan_tiling still tiles every
        # matmul whose weight + gradient would not fit in half the budget; tiles=1 forces one tile
        opts["tile_threshold_bytes"] = 2**62
        opts["tiles"] = 1
    return opts


# ---------------------------------------------------------------------------------------------
# one attempt (subprocess)
# ---------------------------------------------------------------------------------------------

def run_attempt(hd: int, mode: str, args: argparse.Namespace) -> None:
    """One training step of the GPT at hidden size ``hd``; writes a JSON record to ``--json-out``."""
    result: Dict[str, Any] = {"hd": hd, "mode": mode, "ok": False, "stage": "import"}
    lock = threading.Lock()

    def write(extra: Dict[str, Any]) -> None:
        with lock:
            result.update(extra)
            result["child_peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with open(args.json_out, "w") as f:
                json.dump(result, f)

    def guard() -> None:  # leave the machine usable for everyone else rather than meet the OOM killer
        while True:
            if mem_available() < args.guard_gib * GIB:
                write({"ok": False, "reason": "host-memory-guard",
                       "error": f"MemAvailable fell under {args.guard_gib} GiB during stage {result['stage']!r}"})
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=guard, daemon=True).start()
    import torch

    import zinf_compile
    from zinf_compile.models import GPT, GPTConfig, make_batch
    from zinf_runtime.accounting import ZinfOutOfMemoryError

    torch.set_num_threads(args.threads)
    heads = max(1, hd // args.head_dim)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=hd, heads=heads)
    result.update(heads=heads, budget=args.budget_mib * MIB, options=options_for(mode, args.budget_mib * MIB))
    t0 = t1 = time.perf_counter()
    try:
        result["stage"] = "build"
        torch.manual_seed(0)
        model = GPT(cfg)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["build_s"] = time.perf_counter() - t0
        result["stage"] = "compile+step"
        cmodel = torch.compile(model, backend="zinf", options=options_for(mode, args.budget_mib * MIB))
        opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = make_batch(cfg, args.batch, seed=0)
        zinf_compile.reset_peak_memory_stats()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = cmodel(x, y)
        loss.backward()
        opt.step()
        result["step_s"] = time.perf_counter() - t1
        result["loss"] = float(loss.detach())
        result["ok"], result["reason"] = True, "ok"
    except Exception as e:  # noqa: BLE001 -- any failure is a result to report, not a crash
        oom = next((c for c in causes(e) if isinstance(c, ZinfOutOfMemoryError)), None)
        if oom is not None:  # possibly wrapped (e.g. by Dynamo) -- report the runtime's own message
            result.update(reason="ZinfOutOfMemoryError", error=str(oom), step_s=time.perf_counter() - t1,
                          wrapped_in=None if oom is e else type(e).__name__)
        else:
            result.update(reason=type(e).__name__, error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc()[-3000:])
    result["total_s"] = time.perf_counter() - t0
    dev = zinf_compile.memory_stats()["device"]
    recs = zinf_compile.compile_records()
    write({
        "peak_materialized": dev["materialized"]["peak"], "peak_gathered": dev["gathered"]["peak"],
        "peak_grad_buffer": dev["grad_buffer"]["peak"],
        "graphs": len(recs),
        "tiles_planned": int(recs[-1].counters.get("tiles_planned", 0)) if recs else 0,
        "tiles_planned_all_graphs": sum(int(r.counters.get("tiles_planned", 0)) for r in recs),
        "operators_tiled": sum(int(r.counters.get("operators_tiled", 0)) for r in recs),
        "warnings": [w for r in recs for w in getattr(r, "warnings", [])][:10],
        "loadavg": os.getloadavg(), "threads": torch.get_num_threads(), "zinf_compile_file": zinf_compile.__file__,
    })


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def spawn(hd: int, mode: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Run one attempt in a fresh interpreter, with a timeout; its rusage gives the child's peak RSS."""
    fd, out = tempfile.mkstemp(prefix=f"hidden-{mode}-{hd}-", suffix=".json")
    os.close(fd)
    log = tempfile.TemporaryFile(mode="w+")
    cmd = [sys.executable, os.path.abspath(__file__), "--attempt", str(hd), mode, "--json-out", out,
           "--budget-mib", str(args.budget_mib), "--layers", str(args.layers), "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--batch", str(args.batch), "--head-dim", str(args.head_dim),
           "--threads", str(args.threads), "--guard-gib", str(args.guard_gib)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    status, rusage, timed_out = None, None, False
    while status is None:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            status, rusage = st, ru
            proc.returncode = os.waitstatus_to_exitcode(st)  # reaped here; keep Popen from waiting again
            break
        if time.perf_counter() - t0 > args.timeout and not timed_out:
            timed_out = True
            proc.kill()
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    res: Dict[str, Any] = {"hd": hd, "mode": mode, "ok": False}
    try:
        with open(out) as f:
            text = f.read()
        if text.strip():
            res = json.loads(text)
    finally:
        os.unlink(out)
    log.seek(0)
    tail = log.read()[-2000:]
    log.close()
    if timed_out:
        res.update(ok=False, reason="timeout", error=f"killed after {args.timeout:.0f} s (stage {res.get('stage')})")
    elif proc.returncode != 0 and res.get("reason") != "host-memory-guard":
        res.update(ok=False, reason=f"exit {proc.returncode}", error=tail)
    elif "reason" not in res:
        res.update(ok=False, reason="no result", error=tail)
    res["process_s"] = wall
    res["host_peak_rss_kib"] = rusage.ru_maxrss if rusage is not None else None
    return res


def fmt_bytes(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'mode':<8} {'hd':>5} {'params':>13} {'est GiB':>8} {'result':<22} {'mat. MiB':>9} {'gath. MiB':>9} "
            f"{'tiles':>6} {'step s':>8} {'RSS GiB':>8} {'load':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rss = r.get("host_peak_rss_kib")
        step = r.get("step_s")
        load = r.get("loadavg")
        lines.append(
            f"{r['mode']:<8} {r['hd']:>5} {r.get('params', r['est_params']):>13,} {r['est_gib']:>8.2f} "
            f"{('OK' if r['ok'] else r.get('reason', '?'))[:22]:<22} {fmt_bytes(r.get('peak_materialized')):>9} "
            f"{fmt_bytes(r.get('peak_gathered')):>9} {r.get('tiles_planned', '-')!s:>6} "
            f"{'-' if step is None else f'{step:.2f}':>8} {'-' if rss is None else f'{rss / 2**20:.2f}':>8} "
            f"{'-' if load is None else f'{load[0]:.2f}':>5}")
    lines.append("est GiB = model states at 16 B/param (from 12*layers*hd^2 + vocab*hd); mat. = ACCOUNTING, not a "
                 "measurement: peak of memory_stats()['device']['materialized'] (gathered params + live full "
                 "gradients as the runtime registers them) during the step; tiles = tiles_planned of the "
                 "last compiled graph; step s = the one step incl. compilation; RSS = the attempt's peak resident set")
    files = sorted({r["zinf_compile_file"] for r in rows if r.get("zinf_compile_file")})
    lines.append(f"zinf_compile imported from: {', '.join(files) or '?'}")
    return "\n".join(lines)


def answer(rows: List[Dict[str, Any]], mode: str) -> tuple[Optional[int], str]:
    """The largest hd that succeeded in ``mode`` and what stopped the search there."""
    mine = [r for r in rows if r["mode"] == mode]
    ok = [r["hd"] for r in mine if r["ok"]]
    best = max(ok) if ok else None
    stop = next((r for r in mine if not r["ok"]), None)
    if stop is None:
        why = "end of the size list"
    elif stop.get("reason") == "skipped":
        why = f"host RAM: hd={stop['hd']} skipped ({stop['error']})"
    else:
        why = f"hd={stop['hd']} failed: {stop.get('reason')}: {str(stop.get('error', ''))[:300]}"
    return best, why


def int_list(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--budget-mib", type=int, default=256, help="device_memory_budget in MiB")
    p.add_argument("--sizes", type=int_list, default=int_list(DEFAULT_SIZES), help="hidden sizes, ascending")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64, help="heads = hd // head_dim")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per attempt")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per attempt")
    p.add_argument("--host-limit-gib", type=float, default=14.0, help="skip sizes whose model states exceed this")
    p.add_argument("--guard-gib", type=float, default=1.5,
                   help="an attempt stops itself when the machine's MemAvailable falls under this")
    p.add_argument("--keep-going", action="store_true", help="do not stop a mode at its first failure")
    p.add_argument("--json", metavar="PATH", help="write all attempts here")
    p.add_argument("--attempt", nargs=2, metavar=("HD", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.attempt:
        run_attempt(int(args.attempt[0]), args.attempt[1], args)
        return

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {MODES}")
    sizes = sorted(args.sizes)
    print(f"GPT layers={args.layers} vocab={args.vocab} seq={args.seq} batch={args.batch} heads=hd//{args.head_dim}; "
          f"device_memory_budget={args.budget_mib} MiB; host limit {args.host_limit_gib} GiB; "
          f"MemAvailable {mem_available() / GIB:.1f} GiB; load {os.getloadavg()[0]:.2f}", flush=True)
    rows: List[Dict[str, Any]] = []
    for mode in modes:
        for hd in sizes:
            est_params = approx_params(hd, args.layers, args.vocab)
            est = est_params * BYTES_PER_PARAM
            avail = mem_available()
            base = {"hd": hd, "mode": mode, "est_params": est_params, "est_gib": est / GIB,
                    "exact_params": exact_params(hd, args.layers, args.vocab, args.seq)}
            if est > args.host_limit_gib * GIB or est > 0.85 * avail:
                limit = "--host-limit-gib" if est > args.host_limit_gib * GIB else "85% of MemAvailable"
                row = dict(base, ok=False, reason="skipped",
                           error=f"model states ~{est / GIB:.1f} GiB > {limit} "
                                 f"({args.host_limit_gib} GiB; MemAvailable {avail / GIB:.1f} GiB)")
                print(f"[{mode} hd={hd}] skipped: {row['error']}", flush=True)
                rows.append(row)
                if not args.keep_going:
                    break
                continue
            print(f"[{mode} hd={hd}] running (~{est_params / 1e6:.0f}M params, states ~{est / GIB:.2f} GiB, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
            row = dict(base, **spawn(hd, mode, args))
            rows.append(row)
            step = row.get("step_s")
            print(f"[{mode} hd={hd}] {'OK' if row['ok'] else 'FAILED: ' + str(row.get('reason'))}"
                  f"{'' if step is None else f', step {step:.2f} s'}, peak materialized "
                  f"{fmt_bytes(row.get('peak_materialized'))} MiB, tiles {row.get('tiles_planned', '-')}, "
                  f"RSS {(row.get('host_peak_rss_kib') or 0) / 2**20:.2f} GiB, process {row['process_s']:.0f} s"
                  + (f"\n    {str(row.get('error'))[:400]}" if not row["ok"] else ""), flush=True)
            if not row["ok"] and not args.keep_going:
                break
    print()
    print(table(rows))
    answers = {m: answer(rows, m) for m in modes}
    parts = [f"largest hd {m}: {a[0]} (limited by: {a[1]})" for m, a in answers.items()]
    print("\n".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("attempt", "json_out")},
                       "rows": rows, "answers": {m: {"largest_hd": a[0], "limited_by": a[1]}
                                                 for m, a in answers.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
