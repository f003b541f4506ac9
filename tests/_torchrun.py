"""Run ``tests/workers/<worker>`` on 2 gloo ranks under torchrun, on a free port (shared by tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(worker: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), os.path.join(HERE, "workers", worker), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def run_modes(worker: str, out, modes=("zinf", "eager"), timeout: float = 300) -> dict:
    """Run ``worker MODE OUT/MODE`` under torchrun for each mode (it writes ``result{rank}.pt`` there);
    returns ``{mode: [rank 0's result, rank 1's]}``, failing with the workers' output if one failed."""
    import torch

    runs = {}
    for mode in modes:
        proc = torchrun(worker, mode, str(out / mode), timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[mode] = [torch.load(out / mode / f"result{r}.pt") for r in range(2)]
    return runs
