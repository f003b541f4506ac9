"""The ``torch.ops.zinf`` operators: the only interface between compiled graphs and the runtime.

The compiler's passes insert these nodes; the runtime owns every byte they touch. A use of a
partitioned parameter ``p`` (a 0-byte placeholder in the graph) becomes::

    shard = zinf.fetch_shard(p, uid, shard_numel, dtype)   # own 1/dp shard -> compute device
    full  = zinf.all_gather(shard, uid, shape)               # every rank's shard -> full parameter
                                                             # (dp = 1: aten.view(shard, shape))
    ...uses of full...
    zinf.release(full, uid, [readers...])                     # storage freed, accounting updated
    ...
    zinf.keep([shard, full, ...])                             # the graph's last op (passes/keep_alive.py):
                                                              # no compiler reuses runtime-owned memory

and in backward, the gradient ``g`` of ``p``::

    zinf.reduce_grad(g, p, uid)                               # reduce-scatter, accumulate fp32 shard
    zinf.reduce_grad(g, p, uid, donated=True)                 # dp 1 (passes/donate_grads.py): the slot
                                                              # may take g's memory (kept to the end)

``uid`` is the parameter the graph was compiled for; the runtime resolves the tensor actually passed
(``store.resolve``), since Dynamo reuses one compiled graph for every instance of a model class.
``grad_of(g, p, uid)`` only marks, in the joint graph, which output is the gradient of ``p``: it makes
the partitioner keep ``p`` (0 bytes) for the backward, and becomes ``reduce_grad`` there.

Scheduled graphs split each transfer into a start returning a ticket and a wait before first use
(``zinf_runtime.transfer`` has the picture)::

    t = zinf.load(p, uid)                               # NVMe -> host (NVMe tier only)
    t = zinf.upload(p, uid, n, dtype, t)                # host -> device
    shard = zinf.wait_upload(t, p, uid, n, dtype)
    t = zinf.gather(shard, uid, shape); full = zinf.wait_gather(t, shard, uid, shape)  # dp > 1
    t = zinf.reduce(g, p, uid); t = zinf.wait_reduce(t, g, p, uid); zinf.wait_offload(t, g, uid)
    ts = zinf.gather_bucket([s1, s2], [u1, u2])         # bucket_bytes: one all-gather, a ticket each
    ts = zinf.reduce_bucket([g1, g2], [p1, p2], [u1, u2])  # and one reduce-scatter
    zinf.carry(zinf.carry_ticket(k), outputs, k, stage, uids)  # a graph's end: the next one's first NVMe reads

A wait takes the tensors its transfer reads (``shard``, ``g``) as arguments: that keeps them live in
the graph until the transfer is done, so no compiler reuses their memory for a later result.

``release`` and ``reduce_grad`` declare a write to their tensor argument: it is true (the storage
is freed or consumed) and it is what keeps DCE and Inductor from dropping or reordering them
before the last reader. ``after`` lists the outputs of every reader of ``full``: a data dependency,
so a scheduler that inlines a reader's computation into a later kernel (Inductor does, for
pointwise reads) must still compute it before the storage goes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import bucket, carry, store, transfer
from .modes import outside_inference_mode

_lib = torch.library.Library("zinf", "DEF")
_lib.define("fetch_shard(Tensor param, int uid, int shard_numel, ScalarType dtype) -> Tensor")
_lib.define("all_gather(Tensor shard, int uid, SymInt[] shape) -> Tensor")
_lib.define("release(Tensor(a!) full, int uid, Tensor[] after) -> ()")
_lib.define("reduce_grad(Tensor(a!) grad, Tensor param, int uid, bool donated=False) -> ()")
_lib.define("keep(Tensor(a!)[] tensors) -> ()")
_lib.define("grad_of(Tensor grad, Tensor param, int uid) -> Tensor")
_lib.define("load(Tensor param, int uid) -> Tensor")
_lib.define("upload(Tensor param, int uid, int shard_numel, ScalarType dtype, Tensor? loaded) -> Tensor")
_lib.define("wait_upload(Tensor ticket, Tensor param, int uid, int shard_numel, ScalarType dtype) -> Tensor")
_lib.define("gather(Tensor shard, int uid, SymInt[] shape) -> Tensor")
_lib.define("wait_gather(Tensor ticket, Tensor shard, int uid, SymInt[] shape) -> Tensor")
_lib.define("reduce(Tensor grad, Tensor param, int uid) -> Tensor")
_lib.define("wait_reduce(Tensor ticket, Tensor grad, Tensor param, int uid) -> Tensor")
_lib.define("wait_offload(Tensor(a!) ticket, Tensor grad, int uid) -> ()")
_lib.define("gather_bucket(Tensor[] shards, int[] uids) -> Tensor[]")
_lib.define("reduce_bucket(Tensor[] grads, Tensor[] params, int[] uids) -> Tensor[]")
_lib.define("carry_ticket(int key) -> Tensor")
_lib.define("carry(Tensor(a!) ticket, Tensor[] after, int key, str stage, int[] uids) -> ()")
_lib.define("copy_out(Tensor t) -> Tensor")


def _fetch_shard(param: torch.Tensor, uid: int, shard_numel: int, dtype: torch.dtype) -> torch.Tensor:
    return store.resolve(param, uid).fetch_shard(dtype)


def _all_gather(shard: torch.Tensor, uid: int, shape: Sequence[int]) -> torch.Tensor:
    h = store.get(uid)
    if h.world == 1:
        raise RuntimeError(f"zinf.all_gather on {h.name!r}: dp = 1 graphs view the fetched shard instead")
    return h.all_gather(shard)


def _release(full: torch.Tensor, uid: int, after: Sequence[torch.Tensor]) -> None:
    store.ParamHandle.release(full)


def _reduce_grad(grad: torch.Tensor, param: torch.Tensor, uid: int, donated: bool = False) -> None:
    store.resolve(param, uid).reduce_grad(grad, donated)


def _keep(tensors: Sequence[torch.Tensor]) -> None:
    """Nothing: its reading ``tensors`` at the graph's end is what keeps a compiler from reusing
    their memory, which the runtime owns, for a later result (``passes/keep_alive.py``)."""


def _copy_out(t: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t`` (``passes/copy_escaping.py``: a returned view of a parameter). An opaque
    op, not ``aten.clone``, because Inductor removes a clone whose input it takes for a temporary,
    which here is the parameter's own memory."""
    return t.clone()


def _copy_out_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad


def _grad_of(grad: torch.Tensor, param: torch.Tensor, uid: int) -> torch.Tensor:
    raise RuntimeError("zinf.grad_of is a joint-graph marker, replaced by reduce_grad before running")


for _name, _fn in (
    ("load", transfer.op_load),
    ("upload", transfer.op_upload),
    ("wait_upload", transfer.op_wait_upload),
    ("gather", transfer.op_gather),
    ("wait_gather", transfer.op_wait_gather),
    ("reduce", transfer.op_reduce),
    ("wait_reduce", transfer.op_wait_reduce),
    ("wait_offload", transfer.op_wait_offload),
    ("gather_bucket", bucket.op_gather_bucket),
    ("reduce_bucket", bucket.op_reduce_bucket),
    ("carry_ticket", carry.op_carry_ticket),
    ("carry", carry.op_carry),
    ("fetch_shard", _fetch_shard),
    ("all_gather", _all_gather),
    ("release", _release),
    ("reduce_grad", _reduce_grad),
    ("keep", _keep),
    ("grad_of", _grad_of),
    ("copy_out", _copy_out),
):
    _lib.impl(_name, outside_inference_mode(_fn), "CompositeExplicitAutograd")  # runtime/modes.py

torch.library.register_autograd("zinf::copy_out", _copy_out_backward)


@torch.library.register_fake("zinf::copy_out")
def _copy_out_fake(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


@torch.library.register_fake("zinf::fetch_shard")
def _fetch_shard_fake(param: torch.Tensor, uid: int, shard_numel: int, dtype: torch.dtype) -> torch.Tensor:
    return param.new_empty((shard_numel,), dtype=dtype)


@torch.library.register_fake("zinf::all_gather")
def _all_gather_fake(shard: torch.Tensor, uid: int, shape: Sequence[int]) -> torch.Tensor:
    return shard.new_empty(tuple(shape))


@torch.library.register_fake("zinf::release")
def _release_fake(full: torch.Tensor, uid: int, after: Sequence[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("zinf::reduce_grad")
def _reduce_grad_fake(grad: torch.Tensor, param: torch.Tensor, uid: int, donated: bool = False) -> None:
    return None


@torch.library.register_fake("zinf::keep")
def _keep_fake(tensors: Sequence[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("zinf::grad_of")
def _grad_of_fake(grad: torch.Tensor, param: torch.Tensor, uid: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _ticket_fake(*args: object) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64, device="cpu")


for _name in ("load", "upload", "gather", "reduce", "wait_reduce"):
    torch.library.register_fake(f"zinf::{_name}")(_ticket_fake)


torch.library.register_fake("zinf::gather_bucket")(bucket.gather_bucket_fake)
torch.library.register_fake("zinf::reduce_bucket")(bucket.reduce_bucket_fake)


@torch.library.register_fake("zinf::carry_ticket")
def _carry_ticket_fake(key: int) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64, device="cpu")


@torch.library.register_fake("zinf::carry")
def _carry_fake(ticket: torch.Tensor, after: Sequence[torch.Tensor], key: int, stage: str,
                uids: Sequence[int]) -> None:
    return None


@torch.library.register_fake("zinf::wait_upload")
def _wait_upload_fake(ticket: torch.Tensor, param: torch.Tensor, uid: int, shard_numel: int,
                      dtype: torch.dtype) -> torch.Tensor:
    return param.new_empty((shard_numel,), dtype=dtype)


@torch.library.register_fake("zinf::wait_gather")
def _wait_gather_fake(ticket: torch.Tensor, shard: torch.Tensor, uid: int, shape: Sequence[int]) -> torch.Tensor:
    return shard.new_empty(tuple(shape))


@torch.library.register_fake("zinf::wait_offload")
def _wait_offload_fake(ticket: torch.Tensor, grad: torch.Tensor, uid: int) -> None:
    return None
