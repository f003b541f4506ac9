"""Worker for tests/test_comm_exchange.py: ``comm.reduce_scatter_flat`` on gloo (an exchange) against
torch's ``reduce_scatter_tensor`` on the same inputs. Writes one JSON row per rank to argv[1]."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from zinf_runtime import comm


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rows = {"rank": rank, "world": world, "cases": []}
    g = torch.Generator().manual_seed(100 + rank)
    for per_rank in (1, 1000, (1 << 18) + 3):
        for kind in ("normal", "integer"):
            full = (torch.randn(world * per_rank, generator=g) if kind == "normal"
                    else torch.randint(-1000, 1000, (world * per_rank,), generator=g).float())
            ref, magnitude = torch.empty(per_rank), torch.empty(per_rank)
            dist.reduce_scatter_tensor(ref, full.clone())
            dist.reduce_scatter_tensor(magnitude, full.abs())  # sum of |terms|: the rounding bound's scale
            sync = torch.full((per_rank,), float("nan"))
            comm.reduce_scatter_flat(sync, full, None)
            started = torch.full((per_rank,), float("nan"))
            recv = torch.empty(comm.exchange_numel("reduce_scatter", full.numel(), world))
            pending = comm.reduce_scatter_flat(started, full, None, async_op=True, recv=recv)
            pending.wait()
            pending.wait()  # a second wait sums nothing again
            rows["cases"].append({
                "per_rank": per_rank, "kind": kind, "exchanges": comm.exchanges(full, None),
                "sync_equal": torch.equal(sync, ref), "async_equal": torch.equal(started, ref),
                # two sums of `world` terms in different orders differ by at most 2 (world - 1) roundings
                # of the partial sums, each <= eps * sum |terms|
                "within_rounding": bool(((started - ref).abs()
                                         <= 2 * (world - 1) * torch.finfo(torch.float32).eps * magnitude).all()),
                "input_untouched": torch.equal(full, full.clone()),
            })
    for per_rank in (1, 1000, (1 << 18) + 3):
        shard = torch.randn(per_rank, generator=g)
        ref = torch.empty(world * per_rank)
        dist.all_gather_into_tensor(ref, shard)
        sync = torch.full_like(ref, float("nan"))
        comm.all_gather_flat(sync, shard, None)
        own = shard.clone()
        started, calls = torch.full_like(ref, float("nan")), []
        extra = comm.exchange_numel("all_gather", per_rank, world)
        pending = comm.all_gather_flat(started, own, None, async_op=True, send=torch.empty(extra) if extra else None,
                                       then=lambda: calls.append(1))
        own.fill_(float("nan"))  # the shard was copied (send buffer, or its output row) as the exchange started ...
        pending.wait()
        pending.wait()  # ... and `then` runs once, at the first wait
        packed = torch.full_like(ref, float("nan"))
        if extra:  # the shard packed straight into the send buffer's first row
            send = torch.empty(extra)
            send[:per_rank].copy_(shard)
            comm.all_gather_flat(packed, send[:per_rank], None, async_op=True, send=send).wait()
        else:  # 2 ranks: the shard packed straight into this rank's row of the output
            row = packed.view(world, per_rank)[rank]
            row.copy_(shard)
            comm.all_gather_flat(packed, row, None, async_op=True).wait()
        rows.setdefault("gather", []).append({
            "sync_equal": torch.equal(sync, ref), "async_equal": torch.equal(started, ref),
            "packed_equal": torch.equal(packed, ref), "then": len(calls)})
    # a late peer: the exchange's wait is sliced (ZINF_FAILURE_POLL_S), and must survive its slices
    full = torch.arange(world * 8, dtype=torch.float32) * (rank + 1)
    ref = torch.empty(8)
    dist.reduce_scatter_tensor(ref, full.clone())
    if rank == world - 1:
        time.sleep(1.0)
    late = torch.empty(8)
    t0 = time.monotonic()
    comm.reduce_scatter_flat(late, full, None)
    rows["late_equal"], rows["late_waited_s"] = torch.equal(late, ref), time.monotonic() - t0
    rows["recv_numel"] = comm.exchange_numel("reduce_scatter", full.numel(), world)
    rows["send_numel"] = comm.exchange_numel("all_gather", 8, world)
    try:
        comm.reduce_scatter_flat(torch.empty(8), full, None, recv=torch.empty(3))
        rows["bad_recv"] = "no error"
    except RuntimeError as exc:
        rows["bad_recv"] = str(exc)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
