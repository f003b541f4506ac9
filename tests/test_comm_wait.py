"""``comm.wait``: the sliced wait on a gloo collective, which watches for a failed peer between slices."""

from __future__ import annotations

import pytest


class _FinishedAsTheSliceEnded:
    """A work whose sliced wait timed out although it completed at that moment (seen when a late peer
    arrived as a 0.2 s slice ran out): it is complete, and a plain wait returns."""

    def __init__(self, error: str = "") -> None:
        self.error, self.waits = error, []

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return True


def test_a_work_completed_as_its_slice_ran_out_is_not_an_error():
    from zinf_runtime import comm

    work = _FinishedAsTheSliceEnded()
    comm.wait(work, "all_gather", None)  # returns: it succeeded
    assert len(work.waits) == 2 and work.waits[1] is None
    failed = _FinishedAsTheSliceEnded("Connection closed by peer")
    with pytest.raises(RuntimeError, match="closed by peer"):  # its own error, not the slice's timeout
        comm.wait(failed, "all_gather", None)
