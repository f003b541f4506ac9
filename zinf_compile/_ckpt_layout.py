"""How zinf's shards map onto a ``torch.distributed.checkpoint`` (DCP) checkpoint.

Each partitioned parameter is saved as one logical 1-D fp32 tensor of its ``numel`` elements; each rank
writes only the elements it owns, as a DCP chunk ``[offset, offset + length)`` (padding excluded), so the
checkpoint records the logical layout and not the dp size it was written with::

    store:      rank r holds master[r * shard_numel : (r + 1) * shard_numel]  (padded to dp * shard_numel)
    checkpoint: "model/<fqn>" = TensorStorageMetadata(size=(numel,), chunks=[(offset r*shard, length), ...])
    load, dp':  rank r' asks DCP for [r' * shard', r' * shard' + length') and gets it from whichever
                saved chunks overlap (DCP's own resharding of chunked tensors)

Optimizer moments of a parameter (every per-element state: Adam's ``exp_avg``/``exp_avg_sq``, SGD's
momentum, ...) are saved the same way under ``"optim/<fqn>/<name>"``. A parameter tiled along dim 0
keeps one key: tile i covers the flat range ``[lo_i * row, hi_i * row)``. Tiles along another dim are
not contiguous in the flat parameter, so each has a key of its own (``<fqn>#tile<i>of<T>dim<d>``), and
loading them needs the same tiling.

The planners below add these chunks to DCP's default planners (everything else, buffers, replicated
parameters and pickled metadata, goes through DCP unchanged). Data are resolved one write item at a
time, so an NVMe-resident shard is read from disk only when DCP writes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zinf_runtime.store import ParamHandle


def unit_key(fqn: str, h: ParamHandle, i: int) -> Tuple[str, int, int]:
    """``(key, logical numel, flat offset of unit i in that key)`` for unit ``i`` of ``h``."""
    if h.tiles is None:
        return fqn, h.numel, 0
    if h.tile_dim == 0:
        row = math.prod(h.shape[1:])
        return fqn, h.numel, h.tile_bounds[i][0] * row
    u = h.tiles[i]
    return f"{fqn}#tile{i}of{len(h.tiles)}dim{h.tile_dim}", u.numel, 0


def owned(u: ParamHandle) -> Tuple[int, int]:
    """``(start, length)`` of the elements rank ``u.rank`` owns in unit ``u`` (padding excluded)."""
    lo = u.rank * u.shard_numel
    return lo, max(0, min(u.shard_numel, u.numel - lo))


@dataclass
class Piece:
    """One chunk this rank writes: ``start()`` begins reading it (an NVMe slot's asynchronous read) and
    returns ``(tensor, handle or None)``; the tensor's first ``length`` elements are valid once
    ``handle.wait()`` returned."""

    key: str
    numel: int
    offset: int
    length: int
    start: Callable[[], Tuple[torch.Tensor, Any]]


@dataclass
class Target:
    """One chunk this rank reads: DCP copies elements ``[offset, offset + length)`` of ``key`` into ``dest``."""

    key: str
    numel: int
    offset: int
    dest: torch.Tensor  # 1-D, ``length`` elements


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner plus this rank's flat chunks (``pieces``).

    While DCP writes one chunk, the next ones are already being read (NVMe slots read asynchronously),
    up to ``prefetch_bytes``: a save of NVMe-resident state keeps the disk reading and writing at once.
    The guess of what comes next is DCP's writer order (largest tensors first); a wrong guess costs
    only the overlap, never correctness (a chunk not read ahead is read when asked for).
    """

    def __init__(self, pieces: List[Piece], progress: Optional[Callable[[int], None]] = None,
                 prefetch_bytes: int = 256 << 20):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces: Dict[Tuple[str, int], Piece] = {(p.key, p.offset): p for p in pieces if p.length > 0}
        self._progress = progress
        self._order = sorted(self._pieces, key=lambda k: -self._pieces[k].length)
        self._next = 0
        self._inflight: Dict[Tuple[str, int], Tuple[torch.Tensor, Any]] = {}
        self._inflight_bytes = 0
        self._done: set = set()
        self._prefetch_bytes = prefetch_bytes

    def _top_up(self) -> None:
        while self._next < len(self._order):
            key = self._order[self._next]
            nbytes = 4 * self._pieces[key].length
            if self._inflight and self._inflight_bytes + nbytes > self._prefetch_bytes:
                return
            self._next += 1
            if key in self._done or key in self._inflight:
                continue
            self._inflight[key] = self._pieces[key].start()
            self._inflight_bytes += nbytes

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(p.key, torch.Size([p.offset])), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.length])),
                               properties=TensorProperties(dtype=torch.float32), size=torch.Size([p.numel])))
                 for p in self._pieces.values()]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        idx = write_item.index
        key = (idx.fqn, idx.offset[0]) if idx.offset is not None else None
        piece = self._pieces.get(key) if key is not None else None
        if piece is None:
            return super().resolve_data(write_item)
        entry = self._inflight.pop(key, None)
        if entry is None:
            entry = piece.start()
        else:
            self._inflight_bytes -= 4 * piece.length
        self._done.add(key)
        data, handle = entry
        if handle is not None:
            handle.wait()
        self._top_up()  # the next reads run while DCP writes this one
        if data.numel() != piece.length:
            data = data[: piece.length]
        data = data.detach().to("cpu", torch.float32)
        if self._progress is not None:
            self._progress(piece.length * 4)
        return data if data.untyped_storage().nbytes() == piece.length * 4 else data.clone()


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner plus this rank's flat chunks (``targets``); pickled entries land in
    ``self.loaded_bytes``."""

    def __init__(self, targets: List[Target]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets: Dict[Tuple[str, int], Target] = {(t.key, t.offset): t for t in targets if t.dest.numel() > 0}
        self.loaded_bytes: Dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        by_key: Dict[str, List[Target]] = {}
        for t in self._targets.values():
            by_key.setdefault(t.key, []).append(t)
        items: List[ReadItem] = []
        for key, targets in by_key.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise KeyError(f"zinf: the checkpoint has no entry {key!r}; it was saved from another model "
                               "(or without this state)")
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (targets[0].numel,):
                size = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
                raise ValueError(f"zinf: checkpoint entry {key!r} has logical size {size}, but this model's "
                                 f"parameter has {targets[0].numel} elements; it was saved from another model")
            chunks = [ChunkStorageMetadata(offsets=torch.Size([t.offset]), sizes=torch.Size([t.dest.numel()]))
                      for t in targets]
            items.extend(create_read_items_for_chunk_list(key, md, chunks))
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        t = self._targets.get((index.fqn, index.offset[0])) if index.offset is not None else None
        return t.dest if t is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.loaded_bytes[read_item.dest_index.fqn] = torch.load(value, weights_only=False)
