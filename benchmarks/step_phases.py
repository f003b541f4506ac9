"""Where one training step's time goes, per phase and per thread, at dp 2 (or 1) on this machine.

Why: on two cores a dp-2 step is bound by CPU, not by a transfer, so the question "why is this row
slower than that one" is answered by which phase grew and which thread spent the CPU, not by a
trace of waits. This prints, for the steady steps of one system:

- the median wall time of forward + backward, ``optimizer.step()`` and ``zero_grad()``;
- each thread's CPU seconds and context switches per step (``/proc/self/task``), by thread name
  (zinf's IO threads are ``zinf-swap``, its copy lanes ``zinf-ctx<N>-<lane>``, gloo's are
  ``gloo_tcp_loop`` and ``pt_gloo_runloop``);
- Python's garbage collections per step, by generation, with their time (``gc.callbacks``);
- with NVMe tiers, the swap engines' requests and payload bytes per step (``zinf_compile.io_stats``):
  how many reads and writes the step issued, which is what a per-request cost scales with;
- peak RSS (``VmHWM``) up to the first counted step (it includes the compile), and the peak of the
  counted steps alone (the high-water mark reset there, ``benchmarks/_procmem.py``).

Same model (GPT 25M, seed 0) and global batch as ``benchmarks/compare.py``'s small size::

    torchrun --nproc-per-node 2 benchmarks/step_phases.py fsdp2-cpu
    torchrun --nproc-per-node 2 benchmarks/step_phases.py '{"offload_params":"cpu","offload_optimizer":"cpu"}'
    NVME_DIR=/tmp torchrun --nproc-per-node 2 benchmarks/step_phases.py '{"offload_params":"cpu","offload_optimizer":"nvme"}'

``CFG`` (a JSON dict of ``GPTConfig`` fields) replaces the model, e.g. for a quick smoke run.
``ADAM=fused`` steps with ``fused=True`` (``compare.py --adam fused``); the default is torch's own kernel.
A system is ``fsdp2-cpu`` (``fully_shard`` on each block and the root, ``CPUOffloadPolicy``,
``torch.optim.AdamW``) or a JSON dict of zinf options (``zinf_compile.optim.AdamW``). STEPS (default
12) steps run; the first 3 are not counted. Rank 0 prints. One run is one sample: compare rows only
within one run's machine state, and repeat.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare_worker import _status_kib, adamw_kwargs, fsdp2_shard  # noqa: E402  (the rows compare.py runs)
from _procmem import reset_hwm  # noqa: E402
from compare import SIZES  # noqa: E402

SKIP = 3


def hwm_mib() -> int:
    return _status_kib("VmHWM") // 1024


def thread_cpu() -> Dict[str, List[float]]:
    """``{thread name: [cpu s, voluntary, involuntary switches]}`` summed over threads of one name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[str, List[float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            status = {k: v for k, v in (line.split(":", 1) for line in open(f"/proc/self/task/{tid}/status"))}
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm).rstrip("0123456789-")
        acc = out.setdefault(name, [0.0, 0, 0])
        acc[0] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        acc[1] += int(status["voluntary_ctxt_switches"])
        acc[2] += int(status["nonvoluntary_ctxt_switches"])
    return out


class GcClock:
    """Collections and their time per generation while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0


def _io(model: torch.nn.Module) -> Dict[str, float]:
    """Flat NVMe + cache counters of ``zinf_compile.io_stats`` (empty without NVMe)."""
    try:
        st = zinf_compile.io_stats(model)
    except ValueError:
        return {}
    if not st["nvme"]["reads"] and not st["nvme"]["writes"]:
        return {}
    return {"read bytes": st["nvme"]["bytes_read"], "written bytes": st["nvme"]["bytes_written"],
            "reads": st["nvme"]["reads"], "writes": st["nvme"]["writes"], "cache hits": st["read_cache"]["hits"],
            "params written back": st["kept_params"]["written_back"]}


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    system = sys.argv[1] if len(sys.argv) > 1 else "{}"
    per = 4 // world
    g = torch.Generator().manual_seed(1)
    cfg = {**SIZES["small"], **json.loads(os.environ.get("CFG", "{}"))}
    x = torch.randint(0, cfg["vocab"], (4, cfg["seq"]), generator=g)[rank * per:(rank + 1) * per]
    y = torch.randint(0, cfg["vocab"], (4, cfg["seq"]), generator=g)[rank * per:(rank + 1) * per]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    adamw = adamw_kwargs(os.environ.get("ADAM", "default"))
    if system == "fsdp2-cpu":
        fsdp2_shard(model, offload=True)
        run, opt = model, torch.optim.AdamW(model.parameters(), **adamw)
    else:
        options = json.loads(system)
        if "nvme" in (options.get("offload_params"), options.get("offload_optimizer")):
            options.setdefault("nvme_path", tempfile.mkdtemp(prefix=f"zinf-phases-r{rank}-", dir=os.environ.get("NVME_DIR")))
        run = torch.compile(model, backend="zinf", options=options)
        opt = zinf_compile.optim.AdamW(model.parameters(), **adamw)
    steps = int(os.environ.get("STEPS", "12"))
    phases: Dict[str, List[float]] = {"fwd+bwd": [], "step": [], "zero_grad": [], "total": []}
    clock = GcClock()
    cpu0: Dict[str, List[float]] = {}
    wall0 = 0.0
    hwm_before, reset = 0, False
    for i in range(steps):
        if i == SKIP:
            hwm_before, reset = hwm_mib(), reset_hwm()
            cpu0, wall0, clock.on = thread_cpu(), time.perf_counter(), True
            io0 = _io(model) if system != "fsdp2-cpu" else {}
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = run(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        t3 = time.perf_counter()
        if i >= SKIP:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[k].append(v)
    n = steps - SKIP
    cpu1, wall1 = thread_cpu(), time.perf_counter()
    clock.on = False
    if rank == 0 and n > 0:
        print(f"system {system}, dp {world}, {n} steps counted, loss {loss.item():.4f}")
        print("median s: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items()))
        print(f"wall per step (incl. barrier) {(wall1 - wall0) / n:.3f} s")
        # CPU time comes in clock ticks (10 ms at USER_HZ 100): other threads under 5 ms a step are left
        # out; the main thread always shows, even at 0 on a toy run
        print("per step: thread  cpu s  voluntary  involuntary switches")
        for name, (c, vol, inv) in sorted(cpu1.items(), key=lambda kv: -kv[1][0]):
            b = cpu0.get(name, [0.0, 0, 0])
            if name == "MainThread" or c - b[0] > 0.005 * n:
                print(f"  {name:18s} {(c - b[0]) / n:6.3f} {(vol - b[1]) / n:9.0f} {(inv - b[2]) / n:9.0f}")
        if io0:  # the swap engines' own payload counters: how much each step moved, not what it cost
            io1 = _io(model)
            print("swap per step: " + ", ".join(f"{k} {(io1[k] - io0[k]) / n / (2 ** 20 if 'bytes' in k else 1):.1f}"
                                                + (" MiB" if "bytes" in k else "") for k in io0))
        steady = f"{hwm_mib()} MiB" if reset else "not measured (the kernel refused the reset)"
        print(f"rank 0 peak RSS: up to step {SKIP} {hwm_before} MiB (with the compile); steps {SKIP}.. {steady}")
        print("gc per step: collections by generation " + str([round(c / n, 2) for c in clock.count])
              + ", seconds " + str([round(s / n, 4) for s in clock.seconds]))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
