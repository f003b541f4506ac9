"""A DistributedDataParallel wrapper around a zinf model gets an error naming it and the fix.

Not a parity test (nothing trains), so it stays out of the ATEN_CPU_CAPABILITY=default rerun that
test_dp.py's module mark would put it in.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("order", ["ddp_then_compile", "compile_then_ddp"])
def test_a_ddp_wrapper_gets_an_error_naming_it_and_the_fix(order):
    """zinf reduces gradients itself: DDP around it must fail clearly, not train on doubled reductions."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), os.path.join(HERE, "workers", "ddp_wrapped.py"), order]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "DistributedDataParallel (or FSDP) wrapper around a zinf model" in proc.stderr, proc.stderr[-4000:]
    assert "remove the wrapper" in proc.stderr
