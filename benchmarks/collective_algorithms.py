"""gloo's own all-gather and reduce-scatter against zinf's exchanges (``zinf_runtime.comm.exchanges``),
per call: wall time and the process's CPU time (every thread: gloo's included), dp = 2 on this host.
A third form, "all-to-all", is the exchange as it ran at 2 ranks before they got their own (a chunk to
itself too, ``comm.exchange_numel``), kept to show what that saves.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/collective_algorithms.py [OUT.json]

Why: on a host whose cores also run the compute, a collective's CPU time is compute time lost, and
gloo's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` stage through copies of their own. zinf
runs both as one ``all_to_all_single`` (an all-gather sends its shard replicated, a reduce-scatter
sends each rank its slice and sums what it receives in rank order). Sizes are the full tensor's
(the all-gather's output, the reduce-scatter's input), fp32; 7 MiB is a 25M GPT block's bucket. Each
row alternates the two forms in blocks (drift hits both), one thread per rank as in the dp-2 rows of
``benchmarks/compare.py``. Rank 0 prints medians over blocks and writes them as JSON.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import zinf_compile  # noqa: F401  (installs the failure store provider)
from zinf_runtime import comm

SIZES_MIB = (1, 4, 7, 16, 64)
BLOCKS = 8  # the first 2 are warm-up


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _time(fn: Callable[[], None], calls: int) -> Tuple[float, float]:
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu_s()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls, (_cpu_s() - c0) / calls


FORMS = ("gloo", "zinf exchange", "all-to-all")


def _gather_all_to_all(out: torch.Tensor, shard: torch.Tensor, send: torch.Tensor) -> None:
    """The exchange as zinf ran it at every world size before 2 ranks got their own form: the shard
    replicated into every row of a send buffer, one ``all_to_all_single`` (a chunk to itself too)."""
    world = dist.get_world_size()
    send.view(world, -1).copy_(shard.reshape(1, -1).expand(world, -1))
    dist.all_to_all_single(out, send)


def _reduce_all_to_all(out: torch.Tensor, full: torch.Tensor, recv: torch.Tensor) -> None:
    """The same for a reduce-scatter: every rank's slice received (its own included), summed in rank order."""
    dist.all_to_all_single(recv, full)
    comm.sum_rows(recv.view(dist.get_world_size(), -1), out)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows: List[Dict[str, object]] = []
    for mib in SIZES_MIB:
        numel = (mib << 20) // 4 // world * world
        shard, full, out = torch.randn(numel // world), torch.randn(numel), torch.empty(numel // world)
        gathered, send_all, recv_all = torch.empty(numel), torch.empty(numel), torch.empty(numel)
        extra_send = comm.exchange_numel("all_gather", numel // world, world)
        send = torch.empty(extra_send) if extra_send else None
        recv = torch.empty(comm.exchange_numel("reduce_scatter", numel, world))
        forms = {
            ("all_gather", "gloo"): lambda: gather_native(gathered, shard),
            ("all_gather", "zinf exchange"): lambda: comm.all_gather_flat(gathered, shard, None, send=send),
            ("all_gather", "all-to-all"): lambda: _gather_all_to_all(gathered, shard, send_all),
            ("reduce_scatter", "gloo"): lambda: reduce_native(out, full),
            ("reduce_scatter", "zinf exchange"): lambda: comm.reduce_scatter_flat(out, full, None, recv=recv),
            ("reduce_scatter", "all-to-all"): lambda: _reduce_all_to_all(out, full, recv_all),
        }
        calls = max(3, 64 // mib)
        res: Dict[Tuple[str, str], List[Tuple[float, float]]] = {k: [] for k in forms}
        for block in range(BLOCKS):
            for key in (forms if block % 2 else reversed(list(forms))):
                wall, cpu = _time(forms[key], calls)
                if block >= 2:
                    res[key].append((wall, cpu))
        for op in ("all_gather", "reduce_scatter"):
            row: Dict[str, object] = {"op": op, "mib": mib, "world": world}
            for form in FORMS:
                row[f"{form} ms"] = round(statistics.median(w for w, _ in res[(op, form)]) * 1e3, 3)
                row[f"{form} cpu ms"] = round(statistics.median(c for _, c in res[(op, form)]) * 1e3, 3)
            row["speedup"] = round(row["gloo ms"] / row["zinf exchange ms"], 2)  # type: ignore[operator]
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{op:14s} {mib:3d} MiB: gloo {row['gloo ms']:7.2f} ms (cpu {row['gloo cpu ms']:6.2f}), "
                      f"exchange {row['zinf exchange ms']:7.2f} ms (cpu {row['zinf exchange cpu ms']:6.2f}), "
                      f"{row['speedup']:.2f}x; all-to-all with a chunk to itself {row['all-to-all ms']:7.2f} ms "
                      f"(cpu {row['all-to-all cpu ms']:6.2f})", flush=True)
    if dist.get_rank() == 0 and len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"world": world, "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
