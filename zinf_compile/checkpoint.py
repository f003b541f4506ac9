"""Sharded checkpoints: ``save`` / ``load`` through ``torch.distributed.checkpoint``, ``export`` for eager use.

    zinf_compile.save("ckpt/step_300", cmodel, opt, extra={"sched": sched.state_dict(), "step": 300})
    extra = zinf_compile.load("ckpt/step_300", cmodel, opt)        # before or after the first step
    zinf_compile.export("model.safetensors", cmodel)                # full tensors, for use without zinf

Each rank writes only its own shards (parameter masters and optimizer moments, on any tier; the layout
is in ``_ckpt_layout``), so a checkpoint saved at one dp size loads at another. NVMe-resident state is
streamed: a save reads one shard at a time from its slot as DCP writes it, a load fills bounded
sub-groups (``optimizer_sub_group_bytes``) and writes each back to its slots before reading the next.

A checkpoint is complete or absent::

    save:  rm -rf path.tmp; DCP writes path.tmp/ (fsynced; .metadata last); barrier;
           rank 0: path -> path.old, path.tmp -> path, rm -rf path.old, fsync the parent; barrier
    load:  rank 0 decides which directory is complete (path, else path.old left by a crash between the
           two renames) and broadcasts it; a path.tmp is never read

A failed write (a full disk) removes path.tmp and raises ``CheckpointError`` naming the path and the
file, with the previous checkpoint untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import warnings
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zinf_runtime.modes import outside_inference_mode
from zinf_runtime.optim_adapt import unwrap_optimizer  # a framework's wrapper: its optimizer is saved, loaded

from ._ckpt_load import load_into
from ._ckpt_reader import FastReader
from ._ckpt_state import build_save_state, unwrap

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path (``errno`` when known)."""

    def __init__(self, message: str, errno_: Optional[int] = None):
        super().__init__(message)
        self.errno = errno_


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and hand its result (or its exception) to every rank: collective decisions."""
    result: Any = None
    if _rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            result = ("err", exc)
    if _dist():
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if result[0] == "err":
        raise result[1]
    return result[1]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def _resolve(path: str) -> Optional[str]:
    """Rank 0: the complete checkpoint at ``path`` (recovering ``path.old`` after a crash mid-rename)."""
    if _complete(path):
        return path
    old = path + ".old"
    if _complete(old):
        if os.path.exists(path):  # an incomplete directory under the final name: not ours to trust
            shutil.rmtree(path)
        os.rename(old, path)
        _fsync_dir(os.path.dirname(path) or ".")
        return path
    return None


def checkpoint_exists(path: "str | os.PathLike") -> bool:
    """Whether a complete checkpoint is at ``path`` (collective: rank 0 decides, every rank gets it)."""
    return _from_rank0(lambda: _resolve(os.path.abspath(os.fspath(path))) is not None)


def _root_oserror(exc: BaseException) -> Optional[tuple]:
    """``(OSError, rank)`` that made DCP fail, digging through its per-rank ``CheckpointException``."""
    seen = set()
    stack: list = [(exc, None)]
    while stack:
        e, rank = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e, rank
        for r, failure in (getattr(e, "failures", None) or {}).items():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure  # (exc, traceback)
            if isinstance(inner, BaseException):
                stack.append((inner, r))
        stack.append((e.__cause__, rank))
        stack.append((e.__context__, rank))
    return None


def _quiet_dcp() -> "warnings.catch_warnings":
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return ctx


def _progress(total: int, what: str) -> Optional[Callable[[int], None]]:
    """A tqdm bar on rank 0 for long transfers to a terminal (``ZINF_PROGRESS=1`` forces it, ``0`` never)."""
    force = os.environ.get("ZINF_PROGRESS")
    if _rank() != 0 or force == "0" or (force != "1" and (total < (1 << 30) or not sys.stderr.isatty())):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False)
    return bar.update


@outside_inference_mode  # zinf_runtime.modes: a save from a validation-end callback
def save(path: "str | os.PathLike", model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         *, extra: Optional[Dict[str, Any]] = None) -> str:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path``, atomically; collective.

    Each rank writes its own shards. ``extra``: any picklable values saved alongside (an LR scheduler's
    ``state_dict()``, the step, a data-loader position), returned by ``load``. Returns the path.
    """
    from zinf_runtime.broadcast import refuse_checkpoint

    refuse_checkpoint(model, "save")  # the layout writes rank r's slice; owners would be lost
    path = os.path.abspath(os.fspath(path))
    tmp = path + ".tmp"

    def prepare() -> None:
        if os.path.exists(tmp):  # left by a crashed save: never a checkpoint
            shutil.rmtree(tmp)
        os.makedirs(tmp)

    _from_rank0(prepare)
    state, pieces, total = build_save_state(unwrap(model), unwrap_optimizer(optimizer), extra, FORMAT_VERSION)
    writer = FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True)
    from ._ckpt_layout import SavePlanner

    try:
        ctx = _quiet_dcp()
        try:
            dcp.save(state, storage_writer=writer, planner=SavePlanner(pieces, _progress(total, "zinf save")))
        finally:
            ctx.__exit__(None, None, None)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank raises, root cause named
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        root = _root_oserror(exc)
        if root is None:
            raise CheckpointError(f"zinf: saving checkpoint {path} failed ({type(exc).__name__}: {exc}); the "
                                  f"previous checkpoint at {path}, if any, is intact") from exc
        err, rank = root
        where = f" writing {err.filename}" if err.filename else ""
        on = f" on rank {rank}" if rank is not None else ""
        name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else "OSError"
        hint = " (disk full: free space or save elsewhere)" if err.errno == errno.ENOSPC else ""
        raise CheckpointError(f"zinf: saving checkpoint {path} failed: {name} {err.strerror or err}{where}{on}"
                              f"{hint}; the previous checkpoint at {path}, if any, is intact", err.errno) from exc

    def commit() -> None:
        if not _complete(tmp):
            raise CheckpointError(f"zinf: checkpoint {tmp} has no .metadata after writing; not committed")
        _fsync_dir(tmp)
        old = path + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
        shutil.rmtree(old, ignore_errors=True)

    _from_rank0(commit)  # DCP's finish gathered every rank's writes: all are on disk
    return path


@outside_inference_mode  # zinf_runtime.modes: e.g. a resume from a Lightning callback
def load(path: "str | os.PathLike", model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         *, options: Any = None) -> Dict[str, Any]:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``); collective. Returns ``extra``.

    Works before the first compiled call: a model compiled with ``backend="zinf"`` whose parameters are
    not partitioned yet is partitioned now, with its compile options (``options`` overrides them), and
    the shards are loaded into the store. An uncompiled module gets full tensors. Any dp size.
    """
    from zinf_runtime.broadcast import refuse_checkpoint

    refuse_checkpoint(model, "load", options)
    path = os.path.abspath(os.fspath(path))
    found = _from_rank0(lambda: _resolve(path))
    if found is None:
        raise CheckpointError(f"zinf: no complete checkpoint at {path} (a {path}.tmp left by an interrupted "
                              "save is never loaded)", errno.ENOENT)
    reader_factory = lambda: FastReader(found)  # noqa: E731 - one reader per DCP call

    def run(state: Dict[str, Any], planner: Any) -> None:
        ctx = _quiet_dcp()
        try:
            dcp.load(state, storage_reader=reader_factory(), planner=planner)
        except CheckpointException as exc:  # every rank raises; the root cause is named
            root = _root_oserror(exc)
            if root is None:
                raise
            err, rank = root
            on = f" on rank {rank}" if rank is not None else ""
            raise CheckpointError(f"zinf: loading checkpoint {found} failed{on}: {err}", err.errno) from exc
        finally:
            ctx.__exit__(None, None, None)

    metadata = reader_factory().read_metadata()
    return load_into(model, unwrap_optimizer(optimizer), options, metadata, run, found, FORMAT_VERSION, _progress)


@outside_inference_mode  # zinf_runtime.modes: its reads fill the runtime's buffers
def export(path: "str | os.PathLike", model: torch.nn.Module, format: str = "safetensors") -> str:
    """Write the full ``state_dict`` (``model.state_dict()`` keys, full CPU tensors) for use without zinf.

    ``format``: ``"safetensors"`` or ``"torch"`` (``torch.save``). Collective when dp > 1 (the parameters
    are gathered one at a time); rank 0 writes the file, atomically (``path.tmp`` then rename).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"zinf.export: format must be 'safetensors' or 'torch', got {format!r}")
    from .state import full_state_dict

    path = os.path.abspath(os.fspath(path))
    sd = full_state_dict(unwrap(model), rank0_only=True)

    def write() -> None:
        tmp = path + ".tmp"
        if format == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sd.items()}, tmp, metadata={"format": "pt"})
        else:
            torch.save(sd, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")

    _from_rank0(write)
    return path
