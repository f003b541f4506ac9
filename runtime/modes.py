"""The runtime's code runs with ``torch.inference_mode`` off, whatever mode its caller is in.

Why: inference mode is thread-local and marks every tensor made under it, and an inference tensor
refuses in-place updates outside inference mode (so does a view made under it). The runtime keeps
buffers that outlive a call (pooled NVMe reads, the read cache, shard copies, tickets) and writes
into them from its lane and IO threads, where inference mode is off. So an evaluation under
``torch.inference_mode()`` (Lightning's validation loop and the checkpoint callbacks at its end,
``generate`` loops) made the NVMe upload raise in a lane thread, and a ``state_dict()`` read under
it left cached inference tensors that made the next optimizer step raise::

    before:  with torch.inference_mode(): model(x)       # NVMe tier: RuntimeError in the h2d lane
    after:   every entry point (the zinf ops, served eager calls, gathered/full_state_dict, the
             optimizer's methods, checkpoints) runs its body under inference_mode(False): the
             tensors it makes are normal ones, which inference-mode code reads and writes freely

Only entry points are wrapped; the check is one C call when inference mode is off.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_inference_mode(fn: F) -> F:
    """Decorate an entry point: its body runs with inference mode off."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def normal_tensors() -> Iterator[None]:
    """A block whose tensors are normal ones (inference mode off inside it, if it was on)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            yield
    else:
        yield
