"""Overhead of zinf's failure-aware wait on a gloo collective (dp = 2, CPU).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/collective_wait.py

zinf issues each collective with ``async_op=True`` and waits in 0.5 s slices, reading the failure key
from the c10d store only when a slice runs out (``zinf_runtime.comm.wait``). This times
``comm.all_gather_flat`` (that path; on gloo an exchange, ``comm.exchanges``) against the same
exchange issued by torch synchronously (``all_to_all_single`` of the replicated shard) on the same
tensors, in alternating blocks so drift hits both alike; rank 0 prints the median per call.
(``benchmarks/collective_algorithms.py`` compares the exchange with gloo's own all-gather.)
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import zinf_compile  # noqa: F401  (installs the failure store provider)
from zinf_runtime import comm


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for numel in (1024, 1 << 20):
        shard = torch.ones(numel)
        out = torch.empty(world * numel)
        send = torch.empty(world * numel)
        calls = 200 if numel <= 1024 else 20
        res = {"torch sync": [], "zinf wait": []}
        for block in range(12):
            for name in (res if block % 2 else reversed(list(res))):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if name == "torch sync":
                        send.view(world, numel).copy_(shard.expand(world, numel))
                        dist.all_to_all_single(out, send)
                    else:
                        comm.all_gather_flat(out, shard, None)
                if block >= 2:  # warm-up blocks dropped
                    res[name].append((time.perf_counter() - t0) / calls)
        if dist.get_rank() == 0:
            a, b = statistics.median(res["torch sync"]), statistics.median(res["zinf wait"])
            print(f"all_gather {numel * 4} B/rank: torch sync {a * 1e6:8.1f} us, zinf wait {b * 1e6:8.1f} us "
                  f"({(b - a) / a * 100:+.1f}%)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
