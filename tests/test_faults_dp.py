"""dp = 2 faults: one rank's error stops every rank with that error; ranks with different models are
stopped before their first mismatched collective. Two gloo processes under torchrun (workers/faults_dp.py).

A hang fails at the subprocess timeout; the process group's own timeout is 90 s, so an answer within
60 s can only come from zinf.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "faults_dp.py")


def torchrun(tmp_path, scenarios: list, options: dict, timeout: int = 200):
    out = tmp_path / "res"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), WORKER, str(out), ",".join(scenarios), json.dumps(options)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    res = {}
    for sc in scenarios:
        paths = [f"{out}.{sc}.{r}" for r in range(2)]
        assert all(os.path.exists(p) for p in paths), (sc, proc.stdout[-3000:] + proc.stderr[-6000:])
        res[sc] = [json.load(open(p)) for p in paths]
    return res


def check_mismatch(r0, r1, name):
    for r in (r0, r1):
        msg = r["error"]
        assert msg is not None and "different compiled graphs" in msg, r
        # the first difference names the parameter and both shapes
        assert f"rank 0 has parameter {name!r} (32, 32)" in msg and f"rank 1 has parameter {name!r} (33, 32)" in msg, msg
        assert r["seconds"] < 60, r


def check_failed(r0, r1, cause):
    assert r1["error"] is not None and cause in f"{r1['type']}: {r1['error']}", r1  # rank 1's own error
    assert r1["type"] != "RankFailedError", r1
    assert r0["type"] == "RankFailedError", r0
    msg = r0["error"]
    assert "rank 1 failed in the forward of graph" in msg and cause in msg, msg
    assert r0["seconds"] < 60, r0
    assert r0["steps"] == r1["steps"] == 1  # step 0 trained on both


def test_mismatched_models_then_bad_input_on_rank1(tmp_path):
    """Ranks whose models differ (one more layer; one parameter's shape) raise before any collective, naming it: with
    the parameters partitioned at compile (check_compile) and by zinf_compile.init (the first call's
    collective-sequence fingerprint). Then, in the same process group, a bad token on rank 1 only:
    rank 0 gets RankFailedError naming rank 1, the operation and the error within 60 s."""
    res = torchrun(tmp_path, ["extra_layer", "shape_mismatch", "shape_mismatch_init", "bad_input"],
                   {"compiler": "eager"})
    for r in res["extra_layer"]:  # caught at compile, before partitioning broadcasts a parameter rank 0 lacks
        assert "GraphMismatchError" in r["error"] and "compiling graph" in r["error"], r  # Dynamo wraps it
        assert "rank 0 has <nothing>, rank 1 has parameter 'layers.3.weight' (8, 8)" in r["error"], r
    check_mismatch(*res["shape_mismatch"], "layers.1.weight")
    check_mismatch(*res["shape_mismatch_init"], "Linear.weight")  # init names parameters by their module class
    check_failed(*res["bad_input"], "IndexError: index out of range")


def test_io_error_on_rank1_stops_rank0(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # no read cache: with it, a step reads no parameter file (the optimizer's writes stay cached) and
    # the failing reads this scenario injects would never happen
    res = torchrun(tmp_path, ["io_error"], {"compiler": "eager", "offload_params": "nvme", "nvme_path": str(nvme),
                                            "nvme_read_cache_bytes": 0})
    check_failed(*res["io_error"], "Input/output error")
