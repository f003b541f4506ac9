"""Worker for tests/test_costmodel.py (torchrun, gloo, dp = 2): the collective measurement and its cache.

1. both ranks call ``bandwidths``: measured (all-gather and reduce-scatter tables filled), cached;
2. both call again: read from the cache on both, nothing measured;
3. rank 1 loses its cache file (a rank with a cache and one without): both measure again, together
   (a rank that skipped the collectives would hang the other).
Rank 0 writes a JSON summary to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from zinf_compile import costmodel


def main(out_path: str, cache_root: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    calls = {"collectives": 0}
    real = costmodel._measure_collectives

    def counted(*a, **k):
        calls["collectives"] += 1
        return real(*a, **k)

    costmodel._measure_collectives = counted
    cache = os.path.join(cache_root, f"rank{rank}")  # one cache folder per rank: per-node caches
    sizes = (1 << 16, 1 << 20)
    first = costmodel.bandwidths(None, cache_dir=cache, measure_bytes=1 << 20, sizes=sizes)
    second = costmodel.bandwidths(None, cache_dir=cache, measure_bytes=1 << 20, sizes=sizes)
    after_second = calls["collectives"]
    if rank == 1:
        os.unlink(second.path)
    dist.barrier()
    third = costmodel.bandwidths(None, cache_dir=cache, measure_bytes=1 << 20, sizes=sizes)
    rows = [{"rank": rank, "first_cached": first.cached, "second_cached": second.cached,
             "third_cached": third.cached, "after_second": after_second, "after_third": calls["collectives"],
             "all_gather": {str(k): v for k, v in first.all_gather.items()},
             "reduce_scatter": {str(k): v for k, v in first.reduce_scatter.items()},
             "world": first.key["world"]}]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows[0])
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(every, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
