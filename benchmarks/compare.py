"""zinf side by side with the systems a user would otherwise pick: one command, one run, one table.

Why: zinf's claims (no-offload overhead, offload speed, host memory) only mean something next to
eager PyTorch, Inductor, FSDP2 and DeepSpeed ZeRO-3 on the same model, data and steps, on the same
machine at the same time. Each row runs in a fresh subprocess (``_compare_worker.py``; ``torchrun``
with gloo for dp = 2), with its own empty Inductor cache, so the first step includes a cold compile.

    rows                                        what runs
    eager, inductor                             plain model / torch.compile(model), torch.optim.AdamW, dp 1
    fsdp2-none, fsdp2-cpu                       fully_shard (each Block + root), without / with CPUOffloadPolicy, dp 2
    ds-none, ds-cpu, ds-nvme                    DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu), no / CPU / NVMe offload, dp 2
    zinf-none-dp1, zinf-cpu-dp1, zinf-nvme-dp1  backend="zinf", params + optimizer none / cpu / nvme, dp 1
    zinf-none-dp2, zinf-cpu-dp2, zinf-nvme-dp2  the same at dp 2
    zinf-cpunvme-dp2                            params in CPU memory, optimizer on NVMe, dp 2: what
                                                ds-nvme does by default (DeepSpeed keeps up to
                                                max_in_cpu = 1e9 parameter elements in CPU memory)

    python benchmarks/compare.py                          # both sizes, every row -> benchmarks/results/
    python benchmarks/compare.py --systems zinf           # re-run the six zinf rows, merged into the JSON
    python benchmarks/compare.py --systems 'zinf-*-dp2,ds-nvme' --sizes large
    python benchmarks/compare.py --quick --out /tmp/cmp   # tiny model, 2 timed steps: a smoke test
    python benchmarks/compare.py --sizes small --systems fsdp2-cpu,zinf-cpu-dp2 --repeat 3
                                                          # each row 3 times, round-robin

``--repeat N`` runs the selected rows N times in round-robin order (A B A B ...), each run a fresh
process, so the drift of a shared machine reaches every row alike; a row's step is then the median
of its runs' medians, and the table shows the runs' range. Why: one run per row moved by up to 25%
between runs on this VM, more than some of the differences the goals ask about. Each goal line then
also lists the two rows' ratio in every round and how many rounds met the goal: a round runs its
rows minutes apart, so its ratio carries less of the drift (the verdict stays the ratio of medians).

``--interleave ROUNDS`` (default 8): after a size's rows, the goals whose two systems can share one
process (Inductor and zinf without offload at dp 1; FSDP2 ``CPUOffloadPolicy`` and zinf's CPU offload
at dp 2) are measured again with both built in one process and their steps alternating
(``benchmarks/ab_overhead.py``). Each such goal gets a second line: the median of the rounds' ratios
and its quartiles, beside the fresh-process ratio and each system's step alone in a process of its
own (run beside the pair). Why: a process's speed here follows the machine's
drift for minutes, so runs of the same code minutes apart differed by up to 13%, more than a 5%
goal's margin; interleaved steps see the same machine (``benchmarks/_interleaved.py``).

Rows run in ``RUN_ORDER``, each goal's two rows side by side (the table keeps its own order).

Reported per row: the median of the timed steps (``DEFAULT_STEPS``: 10 at 25M, 5 at 124M; after the
first step and ``--warmup`` steps), the CPU seconds a timed step cost (user + system, every thread,
summed over ranks; each goal line shows the two rows' ratio of it beside the verdict, which stays the
step time's), the first step (includes
compilation), peak RSS as the sum over ranks and the largest rank (each rank's
``VmHWM``; the torchrun launcher is not counted), the last loss, and ratios against Inductor. A row
that fails keeps its place with its error's first line. Results merge by (size, row) into
``compare.json``: rows not re-run keep their numbers and their own timestamp and load average.
DeepSpeed rows need ``make bench-setup``.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_interleaved() -> Any:
    """``benchmarks/_interleaved.py`` (it imports no torch either), loaded by path: this module is also
    imported by tests, and putting ``benchmarks/`` on ``sys.path`` would let its scripts shadow modules."""
    spec = importlib.util.spec_from_file_location("zinf_bench_interleaved", os.path.join(HERE, "_interleaved.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


_interleaved = _load_interleaved()

WORKER = os.path.join(HERE, "_compare_worker.py")
ADAM_KINDS = ("default", "fused")  # the worker's (_compare_worker.ADAM_KINDS; not imported: it imports torch)

# row -> (worker system, dp). No row name is also a family name, so --systems is never ambiguous.
ROWS: Dict[str, tuple] = {
    "eager": ("eager", 1), "inductor": ("inductor", 1),
    "fsdp2-none": ("fsdp2", 2), "fsdp2-cpu": ("fsdp2-cpu", 2),
    "ds-none": ("ds", 2), "ds-cpu": ("ds-cpu", 2), "ds-nvme": ("ds-nvme", 2),
    "zinf-none-dp1": ("zinf", 1), "zinf-cpu-dp1": ("zinf-cpu", 1), "zinf-nvme-dp1": ("zinf-nvme", 1),
    "zinf-none-dp2": ("zinf", 2), "zinf-cpu-dp2": ("zinf-cpu", 2), "zinf-nvme-dp2": ("zinf-nvme", 2),
    "zinf-cpunvme-dp2": ("zinf-cpunvme", 2),
}
LABELS = {
    "eager": "eager PyTorch", "inductor": "torch.compile (Inductor)",
    "fsdp2-none": "FSDP2", "fsdp2-cpu": "FSDP2 + CPUOffloadPolicy",
    "ds-none": "DeepSpeed ZeRO-3", "ds-cpu": "DeepSpeed ZeRO-3, CPU offload",
    "ds-nvme": "DeepSpeed ZeRO-3, NVMe offload (its default: params in CPU memory, optimizer on NVMe)",
    "zinf-none-dp1": "zinf", "zinf-cpu-dp1": "zinf, CPU offload", "zinf-nvme-dp1": "zinf, NVMe offload",
    "zinf-none-dp2": "zinf", "zinf-cpu-dp2": "zinf, CPU offload", "zinf-nvme-dp2": "zinf, NVMe offload",
    "zinf-cpunvme-dp2": "zinf, optimizer on NVMe (params in CPU memory)",
}
# --systems also takes these families, and shell-style patterns over row names ("zinf-*-dp2", "*-nvme*")
FAMILIES = {"zinf": [r for r in ROWS if r.startswith("zinf")], "ds": ["ds-none", "ds-cpu", "ds-nvme"],
            "deepspeed": ["ds-none", "ds-cpu", "ds-nvme"], "fsdp2": ["fsdp2-none", "fsdp2-cpu"],
            "peers": ["eager", "inductor", "fsdp2-none", "fsdp2-cpu", "ds-none", "ds-cpu", "ds-nvme"]}

# The step-time goals: (text, zinf row, peer row, the most zinf's step may be, as a ratio)
GOALS = [("zinf no offload <= 1.05x Inductor", "zinf-none-dp1", "inductor", 1.05),
         ("zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy", "zinf-cpu-dp2", "fsdp2-cpu", 0.9),
         ("zinf CPU offload (dp 2) < DeepSpeed CPU offload", "zinf-cpu-dp2", "ds-cpu", 1.0),
         ("zinf NVMe offload (dp 2) <= 0.8x DeepSpeed NVMe offload", "zinf-nvme-dp2", "ds-nvme", 0.8),
         ("like for like: zinf optimizer on NVMe (dp 2) <= 0.8x DeepSpeed NVMe offload", "zinf-cpunvme-dp2",
          "ds-nvme", 0.8)]

# The order rows run in (the table keeps ROWS' order): each goal's rows side by side, so the two steps a
# goal compares are measured about a minute apart rather than up to five. Why: this VM's speed drifts
# for minutes at a time (fresh processes of the same code differed by up to 25% within an hour), and a
# goal's ratio only carries the drift that happened between its two rows.
RUN_ORDER = ["eager", "inductor", "zinf-none-dp1", "zinf-cpu-dp1", "zinf-nvme-dp1",
             "fsdp2-none", "zinf-none-dp2", "fsdp2-cpu", "zinf-cpu-dp2", "ds-cpu",
             "ds-none", "zinf-nvme-dp2", "ds-nvme", "zinf-cpunvme-dp2"]
assert sorted(RUN_ORDER) == sorted(ROWS)

# Timed steps per size when --steps is not given: ten where a step takes about a second (the rows'
# time is mostly their compile, so ten cost ~100 s over 14 rows), five where it takes 3-7 s. Why: a
# median of three steps moved with one slow stretch of the machine or one gen-2 garbage collection.
DEFAULT_STEPS = {"quick": 2, "small": 10, "large": 5}

# GPT-style sizes (zinf_compile.models.GPTConfig); the LM head is tied to the token embedding
SIZES: Dict[str, Dict[str, Any]] = {
    "quick": dict(vocab=256, seq=32, layers=2, hidden=64, heads=4),
    "small": dict(vocab=10240, seq=128, layers=12, hidden=384, heads=6),   # 25.2M params
    "large": dict(vocab=50304, seq=128, layers=12, hidden=768, heads=12),  # 124.1M params (GPT-2 small)
}


def _params(cfg: Dict[str, Any]) -> int:
    """Parameter count of ``GPT(GPTConfig(**cfg))`` with its default biases (no model is built)."""
    h, v, s, n = cfg["hidden"], cfg["vocab"], cfg["seq"], cfg["layers"]
    block = 2 * 2 * h + 3 * h * h + h * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
    return v * h + s * h + n * block + 2 * h


# ------------------------------------------------------------------------------------------------
# the machine
# ------------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def loadavg() -> List[float]:
    return [float(x) for x in _read("/proc/loadavg").split()[:3]] or [float("nan")] * 3


def machine(nvme_root: str) -> Dict[str, Any]:
    """What the numbers were measured on: CPU, cores, RAM, the NVMe folder's disk, library versions."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_kib = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), 0)
    du = shutil.disk_usage(nvme_root)
    dev = fs = ""
    best = ""
    for ln in _read("/proc/mounts").splitlines():
        d, mnt, typ = ln.split()[:3]
        if nvme_root.startswith(mnt) and len(mnt) > len(best):
            best, dev, fs = mnt, d, typ
    rot = _read(f"/sys/block/{os.path.basename(dev)}/queue/rotational").strip()
    versions: Dict[str, str] = {"python": platform.python_version()}
    for mod in ("torch", "deepspeed"):  # from the package metadata: importing deepspeed may JIT-build an op
        code = f"import importlib.metadata as m; print(m.version({mod!r}))"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(1))
        versions[mod] = p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1),
            "disk": {"device": dev, "fs": fs, "mount": best, "size_gib": round(du.total / 2**30),
                     "free_gib": round(du.free / 2**30), "rotational": rot or "?"},
            "nvme_root": nvme_root, "kernel": platform.release(), "versions": versions}


# ------------------------------------------------------------------------------------------------
# running rows
# ------------------------------------------------------------------------------------------------
def _env(threads: int, cache: Optional[str] = None) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
    # DeepSpeed's JIT-built ops live beside this venv (as make bench-setup built them), not in the
    # per-user ~/.cache/torch_extensions, where another checkout's torch would rebuild them under a lock
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _why(out: str, dp: int, log: str, rc: Optional[int]) -> str:
    """The error's first line: from a rank's ``.err`` file, else the log's last exception line."""
    for r in range(dp):
        text = _read(f"{out}.rank{r}.err").strip()
        if text:
            return text.splitlines()[0]
    if rc is None:
        return "timed out"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    exc = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln and not ln.startswith("File ")]
    return (exc[-1] if exc else (lines[-1] if lines else f"exit status {rc}"))[:300]


def run_row(row: str, size: str, cfg: Dict[str, Any], args: argparse.Namespace, tmp: str,
            steps: int) -> Dict[str, Any]:
    system, dp = ROWS[row]
    threads = args.threads_dp1 if dp == 1 else args.threads_dp2
    work = tempfile.mkdtemp(prefix=f"{size}-{row}-", dir=tmp)
    nvme = tempfile.mkdtemp(prefix=f"zinf-compare-{row}-", dir=args.nvme_dir)  # same disk for every row
    out = os.path.join(work, "result.json")
    wargs = [WORKER, "--system", system, "--cfg", json.dumps(cfg), "--global-batch", str(args.global_batch),
             "--warmup", str(args.warmup), "--steps", str(steps), "--threads", str(threads),
             "--nvme", nvme, "--adam", args.adam, "--out", out]
    if dp == 1:
        cmd = [sys.executable] + wargs
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port())] + wargs
    load0, t0 = loadavg(), time.time()
    log, rc = _interleaved.run_in_session(cmd, _env(threads, cache=os.path.join(work, "inductor-cache")), args.timeout)
    wall = time.time() - t0
    base = {"row": row, "label": LABELS[row], "size": size, "dp": dp, "threads_per_rank": threads,
            "adam": None if system.startswith("ds") else args.adam,
            "global_batch": args.global_batch, "seq": cfg["seq"], "warmup": args.warmup, "steps": steps,
            "run_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
            "loadavg_before": load0, "loadavg_after": loadavg(), "wall_s": round(wall, 1)}
    with open(os.path.join(args.out, "logs", f"{size}-{row}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + log)
    shutil.rmtree(nvme, ignore_errors=True)
    if rc == 0 and os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
        steps_kib = res.get("rss_hwm_steps_kib") or []
        res.update(base, ok=True, median_step_s=statistics.median(res["step_s"]),
                   rss_sum_mib=sum(res["rss_hwm_kib"]) / 1024, rss_max_mib=max(res["rss_hwm_kib"]) / 1024,
                   rss_steps_sum_mib=sum(steps_kib) / 1024 if steps_kib and None not in steps_kib else None)
        return res
    return dict(base, ok=False, why=_why(out, dp, log, rc))


def combine_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row from its repeated runs (``--repeat``): the step is the median of the runs' median
    steps; the other figures (first step, RSS, loss, time) are those of the run whose median is the
    median (the lower middle for an even count), so they come from one real run. Failed runs are
    listed with their reasons; a row with no successful run is its last failure."""
    ok = [r for r in runs if r.get("ok")]
    failed = [r.get("why", "?") for r in runs if not r.get("ok")]
    if not ok:
        return dict(runs[-1], failed_runs=failed) if len(runs) > 1 else runs[-1]
    if len(runs) == 1:
        return ok[0]
    meds = [r["median_step_s"] for r in ok]
    middle = sorted(ok, key=lambda r: r["median_step_s"])[(len(ok) - 1) // 2]
    cpus = [r["cpu_per_step_s"] for r in ok if r.get("cpu_per_step_s") is not None]
    extra = dict(cpu_per_step_s=statistics.median(cpus), runs_cpu_per_step_s=cpus) if len(cpus) == len(ok) else {}
    return dict(middle, median_step_s=statistics.median(meds), runs_median_step_s=meds,
                runs_at=[r["run_at"] for r in ok], failed_runs=failed, **extra)


def _step_cell(r: Dict[str, Any]) -> str:
    runs = r.get("runs_median_step_s") or []
    cell = f"{r['median_step_s']:.3f}"
    if len(runs) > 1:
        cell += f" ({len(runs)} runs: {min(runs):.3f}–{max(runs):.3f})"
    if r.get("failed_runs"):
        cell += f" ({len(r['failed_runs'])} failed)"
    return cell


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def _disk_cell(r: Dict[str, Any]) -> str:
    """Block-layer bytes per timed step, summed over ranks (``/proc/self/io``): what each system really
    asks of the disk, measured the same way for all (rows from before this column: "-")."""
    if "disk_read_per_step" not in r:
        return "-"
    return f"{r['disk_read_per_step'] / 2**20:.0f} / {r['disk_write_per_step'] / 2**20:.0f}"


def _cpu_cell(r: Dict[str, Any]) -> str:
    """CPU seconds a timed step cost, every thread of every rank (``getrusage``); with ``--repeat`` the
    median over the runs ("-": a row from before this column)."""
    v = r.get("cpu_per_step_s")
    return f"{v:.2f}" if v is not None else "-"


def _cpu_ratio(ra: Dict[str, Any], rb: Dict[str, Any]) -> str:
    """The two rows' CPU seconds a step, as a suffix of a goal line. Why: the wall-time ratio moves with
    whatever else the shared host runs between two rows (a round's ratio of one pair ranged 0.65-1.26
    over two runs); the CPU a step costs moves less (not nothing: one row's went from 0.88 to 1.15
    CPU-s per rank in runs an hour apart), so it helps tell the system from the machine. Shown beside
    the verdict, which stays the step time's, as the issue defines it."""
    a, b = ra.get("cpu_per_step_s"), rb.get("cpu_per_step_s")
    return f"; CPU s a step {a:.2f} / {b:.2f} = {a / b:.2f}x" if a and b else ""


def _steps_rss(r: Dict[str, Any]) -> str:
    """The timed steps' own peak RSS, summed over ranks ("-": a row from before this column, or a
    kernel that refused the reset)."""
    v = r.get("rss_steps_sum_mib")
    return f"{v:.0f}" if v else "-"


def _adam_text(adam: str) -> str:
    """The run's torch AdamW kernel, as the table's header says it (a row merged from a run with the
    other kernel is marked in its own cell)."""
    kernel = ("fused=True (one fused kernel)" if adam == "fused"
              else "torch's default kernel, the for-loop on CPU tensors")
    return f"{kernel} in the eager, Inductor, FSDP2 and zinf rows; DeepSpeed steps with its own"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _paired(ra: Dict[str, Any], rb: Dict[str, Any], goal: float) -> str:
    """With ``--repeat``, the two rows' ratio in each round, as a suffix of the goal line.

    Why: the machine's speed drifts by 10-25% within an hour, and a round runs its rows minutes
    apart, so a round's ratio cancels most of the drift that the ratio of the two rows' medians
    (the verdict, as the issue defines it) carries. Shown only when both rows finished every round
    (runs pair by their order); a verdict is never taken from it."""
    xa, xb = ra.get("runs_median_step_s") or [], rb.get("runs_median_step_s") or []
    if len(xa) < 2 or len(xa) != len(xb) or ra.get("failed_runs") or rb.get("failed_runs"):
        return ""
    per = [p / q for p, q in zip(xa, xb)]
    met = sum(r <= goal and (goal != 1.0 or r < 1.0) for r in per)  # the verdict's own test, per round
    return (f" (per round: {', '.join(f'{r:.2f}' for r in per)}; median {statistics.median(per):.2f}x, "
            f"{met} of {len(per)} rounds within {goal}x)")


def goals(rows: Dict[str, Dict[str, Any]]) -> List[str]:
    """The issue's goals (same run, same machine), reported PASS/MISS; never asserted."""
    def med(r: str) -> Optional[float]:
        return rows[r]["median_step_s"] if rows.get(r, {}).get("ok") else None

    out = []
    for text, a, b, g in GOALS:
        x, y = med(a), med(b)
        ka, kb = rows.get(a, {}).get("adam", "default"), rows.get(b, {}).get("adam", "default")
        if x and y and ka and kb and ka != kb:  # merged runs: one row stepped another AdamW kernel
            out.append(f"n/a  {text}: {a} ran with the {ka} AdamW kernel, {b} with the {kb} one (--adam)")
        elif x and y:
            out.append(f"{'PASS' if x / y <= g and (g != 1.0 or x < y) else 'MISS'} {text}: {x / y:.2f}x"
                       + _paired(rows[a], rows[b], g) + _cpu_ratio(rows[a], rows[b]))
        else:
            out.append(f"n/a  {text}: a row did not run")
    offl = {r: v["rss_sum_mib"] for r, v in rows.items() if v.get("ok") and ("cpu" in r or "nvme" in r) and v["dp"] == 2}
    if any(r.startswith("zinf") for r in offl) and len(offl) > 1:
        low = min(offl, key=offl.get)
        verdict = "PASS" if low.startswith("zinf") else "MISS"
        out.append(f"{verdict} zinf's peak RSS the lowest of the dp-2 offloading rows: lowest is {low} "
                   f"({offl[low]:.0f} MiB summed over ranks)")
    else:
        out.append("n/a  zinf's peak RSS the lowest of the dp-2 offloading rows: no zinf offloading row, or no peer, ran")
    return out


def render(data: Dict[str, Any]) -> str:
    m, c = data["machine"], data["config"]
    lines = [
        "# zinf vs eager, Inductor, FSDP2, DeepSpeed ZeRO-3 (CPU)", "",
        f"Command: `{data['command']}`", "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB RAM, NVMe folders on {m['disk']['device']} "
        f"({m['disk']['fs']}, {m['disk']['size_gib']} GiB, rotational={m['disk']['rotational']}) under "
        f"`{m['nvme_root']}`; kernel {m['kernel']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".", "",
        f"Every row: fp32, AdamW(lr={c['adamw']['lr']}, betas={tuple(c['adamw']['betas'])}, eps={c['adamw']['eps']}, "
        f"weight_decay={c['adamw']['weight_decay']}; {_adam_text(c.get('adam', 'default'))}), seed 0, the same "
        f"batches; a step = forward + backward + "
        f"optimizer step. Global batch {c['global_batch']} sequences (dp-2 rows: {c['global_batch'] // 2} per rank). "
        f"Threads: {c['threads_dp1']} per process at dp 1, {c['threads_dp2']} per rank at dp 2 (2 ranks). "
        f"Step = median of the timed steps (how many: each size's heading) after the first step and "
        f"{c['warmup']} warm-up step(s); rows run with each goal's two rows side by side (RUN_ORDER); "
        f"the first step includes compilation (cold Inductor cache per row). A row shown with \"N runs\" ran "
        f"N times round-robin with the others (--repeat): its step is the median of the runs' medians, its other "
        f"figures those of that middle run, but its CPU s/step, the runs' median. CPU s/step: the CPU seconds "
        f"(user + system, every thread) a timed step cost, summed over ranks. Peak RSS = VmHWM, summed over "
        f"ranks / largest rank; the timed steps' peak resets VmHWM after the warm-up, so it leaves out the "
        f"first step's compile. Ratios are against Inductor (dp 1, no sharding) of the same size.", "",
        f"Load average (1, 5, 15 min) at start {data['loadavg_start']}, at end {data['loadavg_end']}; "
        f"the machine is shared, so each row also records its own (JSON: loadavg_before/after).", "",
    ]
    if data.get("interrupted_at"):
        lines += [f"**The run was stopped during {data['interrupted_at']}**: rows without numbers were not reached.", ""]
    for size, rows in data["rows"].items():
        ref = rows.get("inductor", {}) if rows.get("inductor", {}).get("ok") else {}
        anyrow = next(iter(rows.values()))
        n = next((r["params"] for r in rows.values() if r.get("ok")), _params(data["sizes"][size]))
        lines += [f"## {size}: GPT-style, {n / 1e6:.1f}M params, global batch {anyrow['global_batch']} x "
                  f"{anyrow['seq']} tokens, {anyrow.get('steps', '?')} timed steps", "",
                  "| system | dp | step s | x Ind. | CPU s/step (sum) | first step s | x Ind. | peak RSS MiB (sum) | "
                  "timed steps' peak RSS MiB (sum) | max/rank | x Ind. | disk MiB/step read / write | last loss | "
                  "run at (load 1m) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in ROWS:
            if row not in rows:  # never dropped silently: the row is listed with why it has no numbers
                lines.append(f"| {LABELS[row]} | {ROWS[row][1]} | not run: no result recorded (not requested, or the "
                             f"run stopped before it) | | | | | | | | | | | |")
                continue
            r = rows[row]
            when = f"{r['run_at'][11:16]} ({r['loadavg_before'][0]:.1f})"
            if not r.get("ok"):
                lines.append(f"| {r['label']} | {r['dp']} | not run: {r['why'].replace('|', '/')} | | | | | | | | | | | {when} |")
                continue
            label = r["label"] + (" [fused AdamW]" if r.get("adam") == "fused" else "")
            lines.append(
                f"| {label} | {r['dp']} | {_step_cell(r)} | {_ratio(r['median_step_s'], ref.get('median_step_s'))} "
                f"| {_cpu_cell(r)} | {r['first_step_s']:.1f} | {_ratio(r['first_step_s'], ref.get('first_step_s'))} "
                f"| {r['rss_sum_mib']:.0f} | {_steps_rss(r)} | {r['rss_max_mib']:.0f} "
                f"| {_ratio(r['rss_sum_mib'], ref.get('rss_sum_mib'))} "
                f"| {_disk_cell(r)} | {r['losses'][-1]:.4f} | {when} |")
        for row in rows:
            if row not in ROWS:  # from an older compare.py with other row names: shown, not dropped
                lines.append(f"| {row} (row name unknown to this compare.py) | {rows[row].get('dp', '?')} | "
                             f"{'%.3f' % rows[row]['median_step_s'] if rows[row].get('ok') else 'not run'} "
                             f"| | | | | | | | | | |")
        setups = {(r["global_batch"], r.get("warmup"), r.get("steps"), r["dp"], r["threads_per_rank"]) for r in rows.values()}
        if len({(b, w, n) for b, w, n, _, _ in setups}) > 1 or len({(d, t) for _, _, _, d, t in setups}) > 2:
            lines += ["", "**Rows of this size come from runs with different settings** (global batch, warm-up, "
                      "timed steps or threads): see each row in compare.json before comparing them."]
        lines += [""] + [f"- {g}" for g in goals(rows)]
        lines += [f"- {g}" for g in interleaved_goals(rows, data.get("interleaved", {}).get(size, {}))] + [""]
    return "\n".join(lines) + "\n"


def interleaved_goals(rows: Dict[str, Dict[str, Any]], inter: Dict[str, Dict[str, Any]]) -> List[str]:
    """The goals measured again with both systems in one process (``--interleave``), each beside the
    fresh-process ratio of the same goal; see ``benchmarks/_interleaved.py``."""
    out = []
    for pair in _interleaved.PAIRS:
        res = inter.get(pair[1])
        if res is None:
            continue
        a, b = rows.get(pair[1], {}), rows.get(pair[2], {})
        fresh = a["median_step_s"] / b["median_step_s"] if a.get("ok") and b.get("ok") else None
        out.append(_interleaved.goal_line(res, fresh))
    return out


# row names of the first compare.py (before they were made unambiguous): renamed when a JSON is loaded
LEGACY = {"fsdp2": "fsdp2-none", "ds": "ds-none", "zinf": "zinf-none-dp1", "zinf-cpu": "zinf-cpu-dp1",
          "zinf-nvme": "zinf-nvme-dp1", "zinf-dp2": "zinf-none-dp2"}


def _migrate(data: Dict[str, Any]) -> Dict[str, Any]:
    for rows in data.get("rows", {}).values():
        for old, new in LEGACY.items():
            if old in rows and new not in rows:
                rows[new] = dict(rows.pop(old), row=new, label=LABELS[new])
    return data


def _select(spec: str) -> List[str]:
    rows: List[str] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        picked = [name] if name in ROWS else FAMILIES.get(name) or fnmatch.filter(list(ROWS), name)
        if not picked:
            raise SystemExit(f"--systems: {name!r} matches no row; rows are {', '.join(ROWS)} "
                             f"(or the families {', '.join(FAMILIES)}, or a pattern such as zinf-*-dp2)")
        rows += [r for r in picked if r not in rows]
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="zinf vs eager/Inductor/FSDP2/DeepSpeed: step time, first step, peak RSS.")
    ap.add_argument("--sizes", default="small,large", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--systems", default="all", help="comma list of rows, families (zinf, ds, fsdp2, peers) or patterns (zinf-*-dp2); default all")
    ap.add_argument("--quick", action="store_true", help="tiny model, global batch 4, 2 timed steps (smoke test)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks (default 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 1; quick 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (default per size: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    ap.add_argument("--threads-dp1", type=int, default=os.cpu_count() or 1, help="threads of a dp-1 process")
    ap.add_argument("--threads-dp2", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="threads per dp-2 rank")
    ap.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where the NVMe rows put their folders")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    ap.add_argument("--repeat", type=int, default=1, help="run the rows this many times, round-robin; a row's "
                                                          "step is the median of its runs' medians (default 1)")
    ap.add_argument("--interleave", type=int, default=8, metavar="ROUNDS",
                    help="after a size's rows, measure the goals whose two systems can share a process "
                         "(Inductor vs zinf at dp 1, FSDP2 vs zinf CPU offload at dp 2) with their steps "
                         "alternating, ROUNDS rounds (benchmarks/_interleaved.py); run when both rows are "
                         "selected; 0: never (default 8)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for compare.json / compare.md / logs")
    ap.add_argument("--adam", default="default", choices=ADAM_KINDS,
                    help="the torch AdamW kernel of the eager, Inductor, FSDP2 and zinf rows: torch's default "
                         "(the for-loop on CPU) or fused=True; DeepSpeed rows use their own (default: default)")
    ap.add_argument("--no-merge", action="store_true", help="replace compare.json instead of merging rows into it")
    ap.add_argument("--render-only", action="store_true", help="rewrite compare.md from compare.json; run nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = "quick" if args.sizes == "small,large" else args.sizes
    args.global_batch = args.global_batch or 4
    args.warmup = 1 if args.warmup is None else args.warmup
    if args.quick and args.steps is None:
        args.steps = DEFAULT_STEPS["quick"]
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: must be at least 1")
    if args.interleave < 0:
        raise SystemExit(f"--interleave {args.interleave}: must be 0 (off) or a number of rounds")
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: must be at least 1")
    if args.global_batch % 2:
        raise SystemExit(f"--global-batch {args.global_batch}: must be even (dp-2 rows split it in two)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown {s!r}; sizes are {', '.join(SIZES)}")
    rows = sorted(ROWS if args.systems == "all" else _select(args.systems), key=RUN_ORDER.index)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    path = os.path.join(args.out, "compare.json")
    data: Dict[str, Any] = {}
    if os.path.exists(path) and not args.no_merge:
        with open(path) as f:
            data = _migrate(json.load(f))
    if args.render_only:
        if not data.get("rows"):
            raise SystemExit(f"--render-only: no rows in {path}")
        return _write(data, args.out, path, final=False)
    cmd = "python benchmarks/compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data.update(machine=machine(os.path.abspath(args.nvme_dir)), command=cmd.strip(), sizes=SIZES,
                config={"global_batch": args.global_batch, "warmup": args.warmup,
                        "steps": {size: args.steps or DEFAULT_STEPS[size] for size in sizes},
                        "repeat": args.repeat, "interleave": args.interleave,
                        "threads_dp1": args.threads_dp1, "threads_dp2": args.threads_dp2,
                        "adamw": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
                        "adam": args.adam},
                loadavg_start=loadavg())
    data.setdefault("rows", {})
    tmp = tempfile.mkdtemp(prefix="zinf-compare-")
    # SIGTERM (a kill, a job's time limit) ends the run like Ctrl-C: what was measured is written out
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for size in sizes:
            cfg = SIZES[size]
            runs: Dict[str, List[Dict[str, Any]]] = {row: [] for row in rows}
            for rnd in range(args.repeat):
                for row in rows:
                    tag = f" run {rnd + 1}/{args.repeat}" if args.repeat > 1 else ""
                    print(f"[{time.strftime('%H:%M:%S')}] {size} {row} (dp {ROWS[row][1]}){tag} ...", flush=True)
                    try:
                        runs[row].append(run_row(row, size, cfg, args, tmp, args.steps or DEFAULT_STEPS[size]))
                    except KeyboardInterrupt:
                        print(f"    interrupted: {size} {row}; rows keep the runs they finished (or their earlier results)")
                        data["interrupted_at"] = f"{size} {row} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
                        return _write(data, args.out, path, status=130)
                    res = runs[row][-1]
                    data["rows"].setdefault(size, {})[row] = combine_runs(runs[row])
                    if res["ok"]:
                        print(f"    step {res['median_step_s']:.3f} s, first {res['first_step_s']:.1f} s, "
                              f"RSS {res['rss_sum_mib']:.0f} MiB (max/rank {res['rss_max_mib']:.0f}), "
                              f"loss {res['losses'][-1]:.4f}, wall {res['wall_s']} s", flush=True)
                    else:
                        print(f"    not run: {res['why']}", flush=True)
                    data["loadavg_end"] = loadavg()
                    with open(path, "w") as f:  # after every row: an interrupted run keeps what it measured
                        json.dump(data, f, indent=1)
            for pair in _interleaved.PAIRS if args.interleave else ():
                if pair[1] not in rows or pair[2] not in rows:
                    continue
                threads = args.threads_dp1 if pair[4] == 1 else args.threads_dp2
                print(f"[{time.strftime('%H:%M:%S')}] {size} interleaved: {pair[2]} and {pair[1]} in one process "
                      f"(dp {pair[4]}), {args.interleave} rounds ...", flush=True)
                try:
                    res = _interleaved.run_pair(pair, size, args.interleave, args.global_batch, threads, args.adam,
                                                args.timeout, _env(threads), free_port=_free_port,
                                                log_path=os.path.join(args.out, "logs", f"{size}-interleaved-{pair[1]}.log"))
                except KeyboardInterrupt:
                    data["interrupted_at"] = f"{size} interleaved {pair[1]} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
                    return _write(data, args.out, path, status=130)
                data.setdefault("interleaved", {}).setdefault(size, {})[pair[1]] = res
                print("    " + _interleaved.goal_line(res, None), flush=True)
                with open(path, "w") as f:
                    json.dump(data, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data.pop("interrupted_at", None)
    return _write(data, args.out, path)


def _write(data: Dict[str, Any], out: str, path: str, status: int = 0, final: bool = True) -> int:
    """compare.json and compare.md from ``data``; prints the markdown."""
    if final:
        data["loadavg_end"] = loadavg()
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    md = render(data)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    return status


if __name__ == "__main__":
    sys.exit(main())
