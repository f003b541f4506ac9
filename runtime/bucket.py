"""Coalesced all-gathers: the shards of several small parameters gathered by one collective.

Why: one gloo or NCCL call per parameter is latency-bound for small parameters (biases, norms),
which DeepSpeed and FSDP2 answer with buckets. With ``bucket_bytes`` the schedule pass replaces the
gather starts of consecutive small parameters by one ``zinf.gather_bucket``; each parameter keeps its
own ticket and its own ``wait_gather``, so nothing else in the graph changes::

    before:  t1 = zinf.gather(s1, u1, shape1); t2 = zinf.gather(s2, u2, shape2)
    after:   ts = zinf.gather_bucket([s1, s2], [u1, u2]); t1 = ts[0]; t2 = ts[1]
             ... w1 = zinf.wait_gather(t1, s1, u1, shape1) ... w2 = zinf.wait_gather(t2, s2, u2, shape2)

Each rank sends its shards packed one after the other; the collective returns them rank by rank, so
parameter i's gathered buffer is column block i of a (world, sum of shard sizes) view, copied out at
the first wait of any member (one copy, as FSDP2's copy-out; the values are the same bytes as a
per-parameter gather, so numerics are unchanged). On CUDA, ``work.wait()`` orders the current
stream after the collective before the copy-out, and every buffer the collective reads or writes is
kept alive by the tickets until their waits.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import comm, store
from .transfer import Ticket, _nb


def op_gather_bucket(shards: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    handles = [store.get(u) for u in uids]
    if len(handles) != len(shards) or not handles:
        raise RuntimeError(f"zinf.gather_bucket: {len(shards)} shards for {len(handles)} parameters")
    first = handles[0]
    for h, s in zip(handles, shards):
        if h.world == 1 or h.placement.group is not first.placement.group:
            raise RuntimeError(f"zinf.gather_bucket: {h.name!r} is not partitioned over the same dp > 1 group "
                               f"as {first.name!r}; the schedule pass buckets only such parameters")
        if s.dtype != shards[0].dtype or s.device != shards[0].device or s.numel() != h.shard_numel:
            raise RuntimeError(f"zinf.gather_bucket: the shard of {h.name!r} ({s.dtype}, {s.device}, {s.numel()} "
                               f"elements) does not match the bucket ({shards[0].dtype}, {shards[0].device}) "
                               f"or its {h.shard_numel}-element shard")
    world = first.world
    sizes = [h.shard_numel for h in handles]
    total = sum(sizes)
    eng = first.context.transfers
    eng.enter()
    try:
        packed = torch.cat([s.reshape(-1) for s in shards])
        out = torch.empty(world * total, dtype=packed.dtype, device=packed.device)
        work = comm.all_gather_flat(out, packed, first.placement.group, async_op=True)
        eng.counters["all_gather_bucket"] = eng.counters.get("all_gather_bucket", 0) + 1
        unpacked: Dict[str, Optional[List[torch.Tensor]]] = {"bufs": None}

        def unpack() -> List[torch.Tensor]:
            if unpacked["bufs"] is None:
                if work is not None:
                    work.wait()
                rows = out.view(world, total)
                bufs, off = [], 0
                for h, n in zip(handles, sizes):
                    buf = torch.empty(h.padded_numel, dtype=out.dtype, device=out.device)
                    store._track_gathered(buf, h.name, h.context.accounting)
                    buf.view(world, n).copy_(rows[:, off:off + n])
                    bufs.append(buf)
                    off += n
                unpacked["bufs"] = bufs
            return unpacked["bufs"]  # type: ignore[return-value]

        tickets = []
        for i, (h, s) in enumerate(zip(handles, shards)):
            wait_fn = (lambda i=i: unpack()[i])
            tickets.append(eng.start(Ticket("all_gather", h.name, world * _nb(s), wait_fn, keep=(s, packed, out))))
        return tickets
    finally:
        eng.leave()


def gather_bucket_fake(shards: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    return [torch.empty((1,), dtype=torch.int64, device="cpu") for _ in uids]
