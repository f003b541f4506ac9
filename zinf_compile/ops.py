"""The ops contract: the ``torch.ops.zinf.*`` operators passes may insert, and how to recognise them.

The operators are defined and implemented by the runtime (``zinf_runtime.ops``); the compiler only
names them. Each node a pass inserts carries ``node.meta["zinf"]`` (a dict with at least ``kind``
and ``uid``) saying why it is there; see ``describe``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

import zinf_runtime  # noqa: F401  (registers torch.ops.zinf.*)

FETCH_SHARD = torch.ops.zinf.fetch_shard.default
ALL_GATHER = torch.ops.zinf.all_gather.default
RELEASE = torch.ops.zinf.release.default
REDUCE_GRAD = torch.ops.zinf.reduce_grad.default
GRAD_OF = torch.ops.zinf.grad_of.default  # joint-graph marker only
# the scheduled form: a start returning a ticket, a wait before first use (zinf_runtime.transfer)
LOAD = torch.ops.zinf.load.default
UPLOAD = torch.ops.zinf.upload.default
WAIT_UPLOAD = torch.ops.zinf.wait_upload.default
GATHER = torch.ops.zinf.gather.default
WAIT_GATHER = torch.ops.zinf.wait_gather.default
REDUCE = torch.ops.zinf.reduce.default
WAIT_REDUCE = torch.ops.zinf.wait_reduce.default
WAIT_OFFLOAD = torch.ops.zinf.wait_offload.default
GATHER_BUCKET = torch.ops.zinf.gather_bucket.default  # a list of tickets, one per parameter
REDUCE_BUCKET = torch.ops.zinf.reduce_bucket.default  # likewise
CARRY_TICKET = torch.ops.zinf.carry_ticket.default
CARRY = torch.ops.zinf.carry.default
KEEP = torch.ops.zinf.keep.default  # keep_alive: runtime-owned tensors read at the graph's end
COPY_OUT = torch.ops.zinf.copy_out.default  # copy_escaping: a returned view of a parameter, copied (a plain op)
TICKET_OPS = (LOAD, UPLOAD, GATHER, REDUCE, WAIT_REDUCE, GATHER_BUCKET, REDUCE_BUCKET, CARRY_TICKET)  # their results are tickets, not data
WAIT_OPS = (WAIT_UPLOAD, WAIT_GATHER, WAIT_REDUCE, WAIT_OFFLOAD)

ZINF_OPS = (FETCH_SHARD, ALL_GATHER, RELEASE, REDUCE_GRAD, GRAD_OF) + TICKET_OPS + (WAIT_UPLOAD, WAIT_GATHER,
                                                                                   WAIT_OFFLOAD, CARRY, KEEP)



def is_zinf(node: torch.fx.Node, op: Optional[Any] = None) -> bool:
    if node.op != "call_function":
        return False
    return node.target is op if op is not None else node.target in ZINF_OPS


def tag(node: torch.fx.Node, kind: str, uid: int, **extra: Any) -> None:
    """Record on the node which pass-level decision it implements (read by dumps and ``zinf inspect``)."""
    node.meta["zinf"] = {"kind": kind, "uid": uid, **extra}


def describe(node: torch.fx.Node) -> Optional[dict]:
    return node.meta.get("zinf")
