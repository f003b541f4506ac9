"""Coalesced collectives: the shards of several small parameters gathered, or their gradients
reduce-scattered, by one collective.

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

On gloo both collectives are exchanges (``comm.exchanges``): at 2 ranks a gather packs its shards into
its own row of the output, which goes to the peer, and a reduction adds a receive buffer for the
peer's (total) slice that its wait sums with its own; from 3 ranks a gather packs into the first row of
a (world, total) send buffer that the exchange replicates, and a reduction's receive buffer is
(world, total). A bucket's own buffers (the packed input, the collective's output,
an exchange's receive buffer) are given back at its last member's wait, on the waiting thread,
whoever else still holds them: a ``Work`` references the tensors it was given, and gloo's worker
thread drops that reference just after it signals completion, so freeing by reference count alone
made the bytes outlive the wait whenever that thread was descheduled (the runtime's ``comm`` peak
doubled in 1 of 5 steps on 2 cores). ``BucketBuffers`` frees their storage
(``store.drop_storage``), as ``ParamHandle.release`` frees a gathered parameter's.

In backward, ``zinf.reduce_bucket([g1, g2], [p1, p2], [u1, u2])`` starts one reduce-scatter once the
last member's gradient exists; each member's ``wait_reduce``/``wait_offload`` stay its own.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import comm, store
from .tiers import BufferPool, flat_buffer
from .transfer import Ticket, _nb


class BucketBuffers:
    """A bucket's private flat buffers and its members' waits still to come; the last frees them
    (back to the context's pool when they came from it, ``flat_buffer``)."""

    __slots__ = ("tensors", "release", "waits", "pool")

    def __init__(self, tensors: Tuple[torch.Tensor, ...], release: Callable[[], Any], waits: int,
                 pool: Optional[BufferPool] = None) -> None:
        self.tensors = tensors
        self.release = release  # the accounting's booking, run once (here, or when the output dies)
        self.waits = waits
        self.pool = pool

    def waited(self) -> None:
        """One member's wait returned (the collective is complete and its values copied out)."""
        self.waits -= 1
        if self.waits == 0:
            for t in self.tensors:
                if self.pool is not None:
                    self.pool.release(t)
                else:
                    store.drop_storage(t)
            self.tensors = ()
            self.release()


def bucket_buffers(ctx: Any, device: torch.device, dtype: torch.dtype, numels: Tuple[int, ...],
                   waits: int) -> Tuple[BucketBuffers, List[torch.Tensor]]:
    """A bucket's flat buffers (the collective's input, its output, and an exchange's receive buffer
    when it has one; or its output alone, when the input is a row of it: ``numels`` elements each),
    booked as ``comm`` bytes and given back by the last of ``waits`` member waits; returns the owner
    and views of exactly ``numels``. The pool is the context's on the host, none on an accelerator."""
    pool = ctx.pool if device.type == "cpu" else None
    raw = tuple(flat_buffer(pool, n, dtype, device) for n in numels)
    output = raw[1] if len(raw) > 1 else raw[0]
    own = BucketBuffers(raw, ctx.accounting.comm_buffers(output, sum(_nb(r) for r in raw)), waits, pool)
    return own, [r[:n] for r, n in zip(raw, numels)]


def op_gather_bucket(shards: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    handles = [store.get(u) for u in uids]
    if len(handles) != len(shards) or not handles:
        raise RuntimeError(f"zinf.gather_bucket: {len(shards)} shards for {len(handles)} parameters")
    first = handles[0]
    for h, s in zip(handles, shards):
        if h.world == 1 or h.placement.group is not first.placement.group or h.placement.partition != "bandwidth":
            raise RuntimeError(f"zinf.gather_bucket: {h.name!r} is not partitioned bandwidth-centric over the same dp > 1 group "
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
        group = first.placement.group
        exchange = comm.exchanges(shards[0], group)
        # the packed shards: an exchange's send buffer (once per rank) from 3 ranks, its own row of the
        # output at 2 (``comm.exchange_numel``), a buffer of their own elsewhere (NCCL)
        send_numel = comm.exchange_numel("all_gather", total, world) if exchange else total
        if send_numel:
            own, (send, out) = bucket_buffers(first.context, shards[0].device, shards[0].dtype,
                                              (send_numel, world * total), len(handles))
            packed = send[:total]
        else:
            own, (out,) = bucket_buffers(first.context, shards[0].device, shards[0].dtype, (world * total,),
                                         len(handles))
            send, packed = None, out.view(world, total)[comm.rank(group)]
        torch.cat([s.reshape(-1) for s in shards], out=packed)
        work = comm.all_gather_flat(out, packed, group, async_op=True, send=send if exchange else None)
        eng.counters["all_gather_bucket"] = eng.counters.get("all_gather_bucket", 0) + 1
        unpacked: Dict[str, Optional[List[torch.Tensor]]] = {"bufs": None}

        def unpack() -> List[torch.Tensor]:
            if unpacked["bufs"] is None:
                if work is not None:
                    work.wait()
                bufs = []
                for h in handles:
                    buf = torch.empty(h.padded_numel, dtype=out.dtype, device=out.device)
                    store._track_gathered(buf, h.name, h.context.accounting)
                    bufs.append(buf)
                # one copy-out call for every member (FSDP2's too): per-member slice + copy_ calls
                # cost ~15 us each inside a step, where small calls run from cold caches
                torch.split_with_sizes_copy(out.view(world, total), sizes, dim=1,
                                            out=[b.view(world, n) for b, n in zip(bufs, sizes)])
                unpacked["bufs"] = bufs
            return unpacked["bufs"]  # type: ignore[return-value]

        def member(i: int) -> torch.Tensor:
            buf = unpack()[i]
            own.waited()
            return buf

        tickets = []
        for i, (h, s) in enumerate(zip(handles, shards)):
            wait_fn = (lambda i=i: member(i))
            tickets.append(eng.start(Ticket("all_gather", h.name, world * _nb(s), wait_fn, keep=(s, send, out))))
        return tickets
    finally:
        eng.leave()


def op_reduce_bucket(grads: List[torch.Tensor], params: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    """One reduce-scatter for the gradients of several small parameters, started once the last of them
    is computed. Rank r's chunk of the packed input is every member's rank-r part, side by side, so each
    element of each shard is summed over the same ranks in the same chunk as alone. Each member's ticket
    is waited by its own ``wait_reduce``, which returns what ``transfer.op_reduce``'s ticket returns."""
    handles = [store.resolve(p, u) for p, u in zip(params, uids)]
    if not handles or len(handles) != len(grads):
        raise RuntimeError(f"zinf.reduce_bucket: {len(grads)} gradients for {len(handles)} parameters")
    first = handles[0]
    eng = first.context.transfers
    eng.enter()
    try:
        tickets: List[Optional[torch.Tensor]] = [None] * len(handles)
        members = []
        for i, (h, g) in enumerate(zip(handles, grads)):
            if (h.tiles is not None or h.world == 1 or h.placement.group is not first.placement.group
                    or h.placement.partition != "bandwidth"):
                h.reduce_grad(g)  # tiled by another compile (or not dp-partitioned like the rest): alone, now
                tickets[i] = eng.done("reduce_scatter", h.name)
            else:
                members.append(i)
        if members:
            world = handles[members[0]].world
            sizes = [handles[i].shard_numel for i in members]
            total = sum(sizes)
            device = grads[members[0]].device
            group = first.placement.group
            exchange = comm.exchanges(grads[members[0]], group)  # + its receive buffer (comm.exchange_numel)
            own, bufs = bucket_buffers(first.context, device, torch.float32,
                                       (world * total, total, comm.exchange_numel("reduce_scatter", world * total, world)
                                        )[: 3 if exchange else 2], len(members))
            flat_pack, out = bufs[0], bufs[1]
            pack = flat_pack.view(world, total)
            buffers, parts = [], []
            for i, n in zip(members, sizes):
                h, g = handles[i], grads[i]
                h._begin_grad()
                buffer = h.context.accounting.gradient_buffer(_nb(g), h.name)
                buffer.__enter__()  # the full gradient is live until its shard is offloaded
                buffers.append(buffer)
                flat = g.detach().reshape(-1).to(torch.float32)
                if h.padded_numel != h.numel:
                    flat = torch.nn.functional.pad(flat, (0, h.padded_numel - h.numel))
                parts.append(flat.view(world, n))
            torch.cat(parts, dim=1, out=pack)  # one packing call (rank r's row: every member's rank-r part)
            work = comm.reduce_scatter_flat(out, flat_pack, group, async_op=True, recv=bufs[2] if exchange else None)
            eng.counters["reduce_scatter_bucket"] = eng.counters.get("reduce_scatter_bucket", 0) + 1
            shards: List[torch.Tensor] = []

            def reduced(k: int) -> tuple:
                if not shards:  # the first member's wait: every member's shard copied out in one call
                    if work is not None:
                        work.wait()
                    out.div_(world)
                    # tensors of their own: a slot keeps its shard (owned), which must not pin or alias the bucket
                    shards.extend(handles[i].new_grad_shard(out.device) for i in members)
                    torch.split_with_sizes_copy(out, sizes, out=shards)
                own.waited()
                return handles[members[k]], shards[k], buffers[k], True

            for k, i in enumerate(members):
                tickets[i] = eng.start(Ticket("reduce_scatter", handles[i].name, _nb(grads[i]),
                                              (lambda k=k: reduced(k)), keep=(grads[i], pack, out)))
        return tickets  # type: ignore[return-value]
    finally:
        eng.leave()


def reduce_bucket_fake(grads: List[torch.Tensor], params: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    return [torch.empty((1,), dtype=torch.int64, device="cpu") for _ in uids]


def gather_bucket_fake(shards: List[torch.Tensor], uids: List[int]) -> List[torch.Tensor]:
    return [torch.empty((1,), dtype=torch.int64, device="cpu") for _ in uids]
