"""The ``torch.ops.zinf`` operators: the only interface between compiled graphs and the runtime.

The compiler's passes insert these nodes; the runtime owns every byte they touch. A use of a
partitioned parameter ``p`` (a 0-byte placeholder in the graph) becomes::

    shard = zinf.fetch_shard(p, uid, shard_numel, dtype)   # own 1/dp shard -> compute device
    full  = zinf.all_gather(shard, uid, shape)               # every rank's shard -> full parameter
                                                             # (dp = 1: aten.view(shard, shape))
    ...uses of full...
    zinf.release(full, uid, [readers...])                     # storage freed, accounting updated

and in backward, the gradient ``g`` of ``p``::

    zinf.reduce_grad(g, uid)                                  # reduce-scatter, accumulate fp32 shard

``release`` and ``reduce_grad`` declare a write to their tensor argument: it is true (the storage
is freed or consumed) and it is what keeps DCE and Inductor from dropping or reordering them
before the last reader. ``after`` lists the outputs of every reader of ``full``: a data dependency,
so a scheduler that inlines a reader's computation into a later kernel (Inductor does, for
pointwise reads) must still compute it before the storage goes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import store

_lib = torch.library.Library("zinf", "DEF")
_lib.define("fetch_shard(Tensor param, int uid, int shard_numel, ScalarType dtype) -> Tensor")
_lib.define("all_gather(Tensor shard, int uid, SymInt[] shape) -> Tensor")
_lib.define("release(Tensor(a!) full, int uid, Tensor[] after) -> ()")
_lib.define("reduce_grad(Tensor(a!) grad, int uid) -> ()")


def _fetch_shard(param: torch.Tensor, uid: int, shard_numel: int, dtype: torch.dtype) -> torch.Tensor:
    return store.get(uid).fetch_shard(dtype)


def _all_gather(shard: torch.Tensor, uid: int, shape: Sequence[int]) -> torch.Tensor:
    h = store.get(uid)
    if h.world == 1:
        raise RuntimeError(f"zinf.all_gather on {h.name!r}: dp = 1 graphs view the fetched shard instead")
    return h.all_gather(shard)


def _release(full: torch.Tensor, uid: int, after: Sequence[torch.Tensor]) -> None:
    store.ParamHandle.release(full)


def _reduce_grad(grad: torch.Tensor, uid: int) -> None:
    store.get(uid).reduce_grad(grad)


for _name, _fn in (
    ("fetch_shard", _fetch_shard),
    ("all_gather", _all_gather),
    ("release", _release),
    ("reduce_grad", _reduce_grad),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


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
def _reduce_grad_fake(grad: torch.Tensor, uid: int) -> None:
    return None
